//! torchvision Inception-v3 (`inception_v3`, `aux_logits` branch left out,
//! `transform_input = False`). Module names are torchvision's.

use super::{classifier_head, image_input, output};
use crate::config::InceptionConfig;
use crate::graph::{Architecture, Builder, Op, INPUT0};

struct Net<'a> {
    b: Builder,
    c: &'a InceptionConfig,
}

/// A branch output: layer reference and its channel count.
type Branch = (i64, usize);

impl Net<'_> {
    /// torchvision's channel count `n`, scaled by the config.
    fn ch(&self, n: usize) -> usize {
        n.div_ceil(self.c.width_divisor).max(1)
    }

    /// `BasicConv2d`: conv (no bias) -> batch_norm -> relu.
    fn basic(
        &mut self,
        name: &str,
        x: Branch,
        out: usize,
        k: [usize; 2],
        s: usize,
        p: [usize; 2],
    ) -> Branch {
        let out = self.ch(out);
        let y = self
            .b
            .conv(&format!("{name}.conv"), x.0, x.1, out, k, [s, s], p, false);
        let y = self
            .b
            .batch_norm(&format!("{name}.bn"), y, out, self.c.bn_eps);
        (self.b.relu(&format!("{name}.relu"), y), out)
    }

    fn max_pool(&mut self, name: &str, x: Branch) -> Branch {
        let op = Op::MaxPool2d {
            kernel: [3, 3],
            stride: [2, 2],
            padding: [0, 0],
            ceil_mode: false,
        };
        (self.b.unary(name, op, x.0), x.1)
    }

    /// `F.avg_pool2d(x, kernel_size=3, stride=1, padding=1)`.
    fn avg_pool(&mut self, name: &str, x: Branch) -> Branch {
        let op = Op::AvgPool2d {
            kernel: [3, 3],
            stride: [1, 1],
            padding: [1, 1],
            ceil_mode: false,
            count_include_pad: true,
        };
        (self.b.unary(name, op, x.0), x.1)
    }

    fn cat(&mut self, name: &str, parts: &[Branch]) -> Branch {
        let id = self.b.concat(name, parts.iter().map(|p| p.0).collect());
        (id, parts.iter().map(|p| p.1).sum())
    }

    fn inception_a(&mut self, m: &str, x: Branch, pool_features: usize) -> Branch {
        let b1 = self.basic(&format!("{m}.branch1x1"), x, 64, [1, 1], 1, [0, 0]);
        let b5 = self.basic(&format!("{m}.branch5x5_1"), x, 48, [1, 1], 1, [0, 0]);
        let b5 = self.basic(&format!("{m}.branch5x5_2"), b5, 64, [5, 5], 1, [2, 2]);
        let b3 = self.basic(&format!("{m}.branch3x3dbl_1"), x, 64, [1, 1], 1, [0, 0]);
        let b3 = self.basic(&format!("{m}.branch3x3dbl_2"), b3, 96, [3, 3], 1, [1, 1]);
        let b3 = self.basic(&format!("{m}.branch3x3dbl_3"), b3, 96, [3, 3], 1, [1, 1]);
        let bp = self.avg_pool(&format!("{m}.avg_pool"), x);
        let bp = self.basic(
            &format!("{m}.branch_pool"),
            bp,
            pool_features,
            [1, 1],
            1,
            [0, 0],
        );
        self.cat(&format!("{m}.cat"), &[b1, b5, b3, bp])
    }

    fn inception_b(&mut self, m: &str, x: Branch) -> Branch {
        let b3 = self.basic(&format!("{m}.branch3x3"), x, 384, [3, 3], 2, [0, 0]);
        let bd = self.basic(&format!("{m}.branch3x3dbl_1"), x, 64, [1, 1], 1, [0, 0]);
        let bd = self.basic(&format!("{m}.branch3x3dbl_2"), bd, 96, [3, 3], 1, [1, 1]);
        let bd = self.basic(&format!("{m}.branch3x3dbl_3"), bd, 96, [3, 3], 2, [0, 0]);
        let bp = self.max_pool(&format!("{m}.max_pool"), x);
        self.cat(&format!("{m}.cat"), &[b3, bd, bp])
    }

    fn inception_c(&mut self, m: &str, x: Branch, c7: usize) -> Branch {
        let (k17, p17, k71, p71) = ([1, 7], [0, 3], [7, 1], [3, 0]);
        let b1 = self.basic(&format!("{m}.branch1x1"), x, 192, [1, 1], 1, [0, 0]);
        let b7 = self.basic(&format!("{m}.branch7x7_1"), x, c7, [1, 1], 1, [0, 0]);
        let b7 = self.basic(&format!("{m}.branch7x7_2"), b7, c7, k17, 1, p17);
        let b7 = self.basic(&format!("{m}.branch7x7_3"), b7, 192, k71, 1, p71);
        let bd = self.basic(&format!("{m}.branch7x7dbl_1"), x, c7, [1, 1], 1, [0, 0]);
        let bd = self.basic(&format!("{m}.branch7x7dbl_2"), bd, c7, k71, 1, p71);
        let bd = self.basic(&format!("{m}.branch7x7dbl_3"), bd, c7, k17, 1, p17);
        let bd = self.basic(&format!("{m}.branch7x7dbl_4"), bd, c7, k71, 1, p71);
        let bd = self.basic(&format!("{m}.branch7x7dbl_5"), bd, 192, k17, 1, p17);
        let bp = self.avg_pool(&format!("{m}.avg_pool"), x);
        let bp = self.basic(&format!("{m}.branch_pool"), bp, 192, [1, 1], 1, [0, 0]);
        self.cat(&format!("{m}.cat"), &[b1, b7, bd, bp])
    }

    fn inception_d(&mut self, m: &str, x: Branch) -> Branch {
        let b3 = self.basic(&format!("{m}.branch3x3_1"), x, 192, [1, 1], 1, [0, 0]);
        let b3 = self.basic(&format!("{m}.branch3x3_2"), b3, 320, [3, 3], 2, [0, 0]);
        let b7 = self.basic(&format!("{m}.branch7x7x3_1"), x, 192, [1, 1], 1, [0, 0]);
        let b7 = self.basic(&format!("{m}.branch7x7x3_2"), b7, 192, [1, 7], 1, [0, 3]);
        let b7 = self.basic(&format!("{m}.branch7x7x3_3"), b7, 192, [7, 1], 1, [3, 0]);
        let b7 = self.basic(&format!("{m}.branch7x7x3_4"), b7, 192, [3, 3], 2, [0, 0]);
        let bp = self.max_pool(&format!("{m}.max_pool"), x);
        self.cat(&format!("{m}.cat"), &[b3, b7, bp])
    }

    fn inception_e(&mut self, m: &str, x: Branch) -> Branch {
        let b1 = self.basic(&format!("{m}.branch1x1"), x, 320, [1, 1], 1, [0, 0]);
        let b3 = self.basic(&format!("{m}.branch3x3_1"), x, 384, [1, 1], 1, [0, 0]);
        let b3a = self.basic(&format!("{m}.branch3x3_2a"), b3, 384, [1, 3], 1, [0, 1]);
        let b3b = self.basic(&format!("{m}.branch3x3_2b"), b3, 384, [3, 1], 1, [1, 0]);
        let b3 = self.cat(&format!("{m}.branch3x3_cat"), &[b3a, b3b]);
        let bd = self.basic(&format!("{m}.branch3x3dbl_1"), x, 448, [1, 1], 1, [0, 0]);
        let bd = self.basic(&format!("{m}.branch3x3dbl_2"), bd, 384, [3, 3], 1, [1, 1]);
        let bda = self.basic(&format!("{m}.branch3x3dbl_3a"), bd, 384, [1, 3], 1, [0, 1]);
        let bdb = self.basic(&format!("{m}.branch3x3dbl_3b"), bd, 384, [3, 1], 1, [1, 0]);
        let bd = self.cat(&format!("{m}.branch3x3dbl_cat"), &[bda, bdb]);
        let bp = self.avg_pool(&format!("{m}.avg_pool"), x);
        let bp = self.basic(&format!("{m}.branch_pool"), bp, 192, [1, 1], 1, [0, 0]);
        self.cat(&format!("{m}.cat"), &[b1, b3, bd, bp])
    }
}

pub(crate) fn build(c: &InceptionConfig) -> Architecture {
    let mut n = Net {
        b: Builder::default(),
        c,
    };
    let x = (INPUT0, c.in_channels);
    let x = n.basic("Conv2d_1a_3x3", x, 32, [3, 3], 2, [0, 0]);
    let x = n.basic("Conv2d_2a_3x3", x, 32, [3, 3], 1, [0, 0]);
    let x = n.basic("Conv2d_2b_3x3", x, 64, [3, 3], 1, [1, 1]);
    let x = n.max_pool("maxpool1", x);
    let x = n.basic("Conv2d_3b_1x1", x, 80, [1, 1], 1, [0, 0]);
    let x = n.basic("Conv2d_4a_3x3", x, 192, [3, 3], 1, [0, 0]);
    let x = n.max_pool("maxpool2", x);
    let x = n.inception_a("Mixed_5b", x, 32);
    let x = n.inception_a("Mixed_5c", x, 64);
    let x = n.inception_a("Mixed_5d", x, 64);
    let x = n.inception_b("Mixed_6a", x);
    let x = n.inception_c("Mixed_6b", x, 128);
    let x = n.inception_c("Mixed_6c", x, 160);
    let x = n.inception_c("Mixed_6d", x, 160);
    let x = n.inception_c("Mixed_6e", x, 192);
    let x = n.inception_d("Mixed_7a", x);
    let x = n.inception_e("Mixed_7b", x);
    let x = n.inception_e("Mixed_7c", x);
    classifier_head(&mut n.b, x.0, x.1, c.num_classes, "fc");
    let last = n.b.last_id();
    n.b.finish(
        image_input(c.batch_size, c.in_channels, c.image_size),
        vec![output("logits", last, vec![c.batch_size, c.num_classes])],
    )
}
