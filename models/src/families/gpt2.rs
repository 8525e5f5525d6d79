//! Hugging Face `GPT2Model` (`gpt2` at full scale, no LM head). Its `Conv1D`
//! layers store weights `[in, out]`: linear layers with `transposed = true`.

use super::{output, token_input};
use crate::config::Gpt2Config;
use crate::graph::{Architecture, Builder, EmbeddingIds, Op, INPUT0};

pub(crate) fn build(c: &Gpt2Config) -> Architecture {
    let mut b = Builder::default();
    let (h, eps) = (c.hidden, c.layer_norm_eps);
    let tokens = b.embedding("wte", INPUT0, c.vocab_size, h, EmbeddingIds::Input);
    let pos = b.embedding("wpe", INPUT0, c.max_positions, h, EmbeddingIds::Positions);
    let mut x = b.add("embeddings.add", tokens, pos);
    for i in 0..c.layers {
        let p = format!("h.{i}");
        let a = b.layer_norm(&format!("{p}.ln_1"), x, h, eps);
        let qkv = b.linear(&format!("{p}.attn.c_attn"), a, h, 3 * h, true);
        let attn = Op::Attention {
            hidden: h,
            heads: c.heads,
            causal: true,
        };
        let a = b.push(&format!("{p}.attn"), attn, vec![qkv], Vec::new());
        let a = b.linear(&format!("{p}.attn.c_proj"), a, h, h, true);
        x = b.add(&format!("{p}.attn.add"), a, x);
        let m = b.layer_norm(&format!("{p}.ln_2"), x, h, eps);
        let m = b.linear(&format!("{p}.mlp.c_fc"), m, h, c.intermediate, true);
        let m = b.unary(
            &format!("{p}.mlp.act"),
            Op::Gelu {
                approximate: c.activation,
            },
            m,
        );
        let m = b.linear(&format!("{p}.mlp.c_proj"), m, c.intermediate, h, true);
        x = b.add(&format!("{p}.mlp.add"), m, x);
    }
    b.layer_norm("ln_f", x, h, eps);
    let last = b.last_id();
    b.finish(
        token_input(c.batch_size, c.seq_len, c.max_positions),
        vec![output(
            "last_hidden_state",
            last,
            vec![c.batch_size, c.seq_len, h],
        )],
    )
}
