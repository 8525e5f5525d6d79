//! torchvision DenseNet-BC (`densenet201` at full scale). Each dense layer
//! reads the concatenation of the block input and every earlier layer's
//! output of its block, in that order (torchvision's `torch.cat(features, 1)`).

use super::{classifier_head, image_input, output};
use crate::config::DensenetConfig;
use crate::graph::{Architecture, Builder, Op, INPUT0};

pub(crate) fn build(c: &DensenetConfig) -> Architecture {
    let mut b = Builder::default();
    let eps = c.bn_eps;
    let f0 = c.init_features;
    let x = b.conv(
        "features.conv0",
        INPUT0,
        c.in_channels,
        f0,
        [7, 7],
        [2, 2],
        [3, 3],
        false,
    );
    let x = b.batch_norm("features.norm0", x, f0, eps);
    let x = b.relu("features.relu0", x);
    let pool0 = Op::MaxPool2d {
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
        ceil_mode: false,
    };
    let mut x = b.unary("features.pool0", pool0, x);
    let mut channels = f0;
    let bottleneck = c.bn_size * c.growth_rate;
    for (i, &layers) in c.blocks.iter().enumerate() {
        let blk = format!("features.denseblock{}", i + 1);
        let mut features = vec![x];
        for j in 1..=layers {
            let p = format!("{blk}.denselayer{j}");
            let in_ch = channels + (j - 1) * c.growth_rate;
            let input = if features.len() == 1 {
                features[0]
            } else {
                b.concat(&format!("{p}.cat"), features.clone())
            };
            let y = b.batch_norm(&format!("{p}.norm1"), input, in_ch, eps);
            let y = b.relu(&format!("{p}.relu1"), y);
            let y = b.conv(
                &format!("{p}.conv1"),
                y,
                in_ch,
                bottleneck,
                [1, 1],
                [1, 1],
                [0, 0],
                false,
            );
            let y = b.batch_norm(&format!("{p}.norm2"), y, bottleneck, eps);
            let y = b.relu(&format!("{p}.relu2"), y);
            let y = b.conv(
                &format!("{p}.conv2"),
                y,
                bottleneck,
                c.growth_rate,
                [3, 3],
                [1, 1],
                [1, 1],
                false,
            );
            features.push(y);
        }
        channels += layers * c.growth_rate;
        x = if features.len() == 1 {
            features[0]
        } else {
            b.concat(&format!("{blk}.cat"), features)
        };
        if i + 1 < c.blocks.len() {
            let t = format!("features.transition{}", i + 1);
            let out = channels / c.transition_divisor;
            let y = b.batch_norm(&format!("{t}.norm"), x, channels, eps);
            let y = b.relu(&format!("{t}.relu"), y);
            let y = b.conv(
                &format!("{t}.conv"),
                y,
                channels,
                out,
                [1, 1],
                [1, 1],
                [0, 0],
                false,
            );
            let pool = Op::AvgPool2d {
                kernel: [2, 2],
                stride: [2, 2],
                padding: [0, 0],
                ceil_mode: false,
                count_include_pad: true,
            };
            x = b.unary(&format!("{t}.pool"), pool, y);
            channels = out;
        }
    }
    let x = b.batch_norm("features.norm5", x, channels, eps);
    let x = b.relu("features.relu5", x);
    classifier_head(&mut b, x, channels, c.num_classes, "classifier");
    let last = b.last_id();
    b.finish(
        image_input(c.batch_size, c.in_channels, c.image_size),
        vec![output("logits", last, vec![c.batch_size, c.num_classes])],
    )
}
