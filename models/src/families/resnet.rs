//! torchvision ResNet with bottleneck blocks (`resnet152` at full scale).

use super::{classifier_head, image_input, output};
use crate::config::ResnetConfig;
use crate::graph::{Architecture, Builder, Op, INPUT0};

pub(crate) fn build(c: &ResnetConfig) -> Architecture {
    let mut b = Builder::default();
    let w0 = c.base_width;
    let x = b.conv(
        "conv1",
        INPUT0,
        c.in_channels,
        w0,
        [7, 7],
        [2, 2],
        [3, 3],
        false,
    );
    let x = b.batch_norm("bn1", x, w0, c.bn_eps);
    let x = b.relu("relu", x);
    let maxpool = Op::MaxPool2d {
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
        ceil_mode: false,
    };
    let mut x = b.unary("maxpool", maxpool, x);
    let mut in_ch = w0;
    for (stage, &blocks) in c.blocks.iter().enumerate() {
        let width = w0 << stage;
        let out_ch = width * c.expansion;
        for block in 0..blocks {
            let stride = if stage > 0 && block == 0 { 2 } else { 1 };
            let p = format!("layer{}.{block}", stage + 1);
            let identity = x;
            let s = [stride, stride];
            let y = b.conv(
                &format!("{p}.conv1"),
                x,
                in_ch,
                width,
                [1, 1],
                [1, 1],
                [0, 0],
                false,
            );
            let y = b.batch_norm(&format!("{p}.bn1"), y, width, c.bn_eps);
            let y = b.relu(&format!("{p}.relu1"), y);
            let y = b.conv(
                &format!("{p}.conv2"),
                y,
                width,
                width,
                [3, 3],
                s,
                [1, 1],
                false,
            );
            let y = b.batch_norm(&format!("{p}.bn2"), y, width, c.bn_eps);
            let y = b.relu(&format!("{p}.relu2"), y);
            let y = b.conv(
                &format!("{p}.conv3"),
                y,
                width,
                out_ch,
                [1, 1],
                [1, 1],
                [0, 0],
                false,
            );
            let y = b.batch_norm(&format!("{p}.bn3"), y, out_ch, c.bn_eps);
            let shortcut = if stride != 1 || in_ch != out_ch {
                let d = format!("{p}.downsample");
                let z = b.conv(
                    &format!("{d}.0"),
                    x,
                    in_ch,
                    out_ch,
                    [1, 1],
                    s,
                    [0, 0],
                    false,
                );
                b.batch_norm(&format!("{d}.1"), z, out_ch, c.bn_eps)
            } else {
                identity
            };
            let y = b.add(&format!("{p}.add"), y, shortcut);
            x = b.relu(&format!("{p}.relu3"), y);
            in_ch = out_ch;
        }
    }
    classifier_head(&mut b, x, in_ch, c.num_classes, "fc");
    let last = b.last_id();
    b.finish(
        image_input(c.batch_size, c.in_channels, c.image_size),
        vec![output("logits", last, vec![c.batch_size, c.num_classes])],
    )
}
