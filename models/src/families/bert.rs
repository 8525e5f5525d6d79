//! Hugging Face `BertModel` (`bert-base-uncased` at full scale): embeddings,
//! encoder, pooler. Token type ids are all zero, position ids 0..L-1 and the
//! attention mask is all ones (no padding).

use super::{output, token_input};
use crate::config::BertConfig;
use crate::graph::{Architecture, Builder, EmbeddingIds, Op, INPUT0};

pub(crate) fn build(c: &BertConfig) -> Architecture {
    let mut b = Builder::default();
    let (h, eps) = (c.hidden, c.layer_norm_eps);
    let e = "embeddings";
    let words = b.embedding(
        &format!("{e}.word_embeddings"),
        INPUT0,
        c.vocab_size,
        h,
        EmbeddingIds::Input,
    );
    let pos = b.embedding(
        &format!("{e}.position_embeddings"),
        INPUT0,
        c.max_positions,
        h,
        EmbeddingIds::Positions,
    );
    let types = b.embedding(
        &format!("{e}.token_type_embeddings"),
        INPUT0,
        c.type_vocab_size,
        h,
        EmbeddingIds::Zeros,
    );
    let x = b.add(&format!("{e}.add_positions"), words, pos);
    let x = b.add(&format!("{e}.add_token_types"), x, types);
    let mut x = b.layer_norm(&format!("{e}.LayerNorm"), x, h, eps);
    for i in 0..c.layers {
        let p = format!("encoder.layer.{i}");
        let q = b.linear(&format!("{p}.attention.self.query"), x, h, h, false);
        let k = b.linear(&format!("{p}.attention.self.key"), x, h, h, false);
        let v = b.linear(&format!("{p}.attention.self.value"), x, h, h, false);
        let attn = Op::Attention {
            hidden: h,
            heads: c.heads,
            causal: false,
        };
        let a = b.push(
            &format!("{p}.attention.self"),
            attn,
            vec![q, k, v],
            Vec::new(),
        );
        let a = b.linear(&format!("{p}.attention.output.dense"), a, h, h, false);
        let a = b.add(&format!("{p}.attention.output.add"), a, x);
        let a = b.layer_norm(&format!("{p}.attention.output.LayerNorm"), a, h, eps);
        let f = b.linear(
            &format!("{p}.intermediate.dense"),
            a,
            h,
            c.intermediate,
            false,
        );
        let f = b.unary(
            &format!("{p}.intermediate.act"),
            Op::Gelu {
                approximate: c.activation,
            },
            f,
        );
        let f = b.linear(&format!("{p}.output.dense"), f, c.intermediate, h, false);
        let f = b.add(&format!("{p}.output.add"), f, a);
        x = b.layer_norm(&format!("{p}.output.LayerNorm"), f, h, eps);
    }
    let hidden_layer = b.last_id();
    let first = b.unary("pooler.first_token", Op::Select { dim: 1, index: 0 }, x);
    let pooled = b.linear("pooler.dense", first, h, h, false);
    b.unary("pooler.activation", Op::Tanh, pooled);
    let last = b.last_id();
    b.finish(
        token_input(c.batch_size, c.seq_len, c.max_positions),
        vec![
            output(
                "last_hidden_state",
                hidden_layer,
                vec![c.batch_size, c.seq_len, h],
            ),
            output("pooler_output", last, vec![c.batch_size, h]),
        ],
    )
}
