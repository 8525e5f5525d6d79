//! One SGD step of the full-scale ResNet-152 (the training model,
//! `resnet152_train`) at batch 2 on the CPU. Release builds only.

use std::time::Instant;

use distmind_models::{generate, Family, GenOptions, Package};
use distmind_runtime::exec::HostTensor;
use distmind_runtime::train::{changed_groups, sgd_step, SgdConfig};

#[test]
#[cfg_attr(debug_assertions, ignore = "release builds only: full-scale training")]
fn train_full_scale_resnet152_batch2() {
    let dir = tempfile::tempdir().unwrap();
    let dirs = generate(&GenOptions::new(Family::Resnet152, dir.path())).expect("generate");
    let pkg = Package::open(&dirs[0]).expect("open");
    let m = &pkg.manifest;
    let mut packed = vec![0u8; m.stored_bytes as usize];
    for g in &m.groups {
        let bytes = pkg.group_bytes(g.index).unwrap();
        packed[g.offset as usize..g.offset as usize + bytes.len()].copy_from_slice(&bytes);
    }
    let before = packed.clone();
    let mut shape = m.inputs[0].shape.clone();
    shape[0] = 2;
    let n: usize = shape.iter().product();
    let x = HostTensor::f32(
        shape,
        (0..n)
            .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
            .collect(),
    );
    let start = Instant::now();
    let r = sgd_step(m, &mut packed, &x, &[3, 999], &SgdConfig::default()).unwrap();
    let total = start.elapsed();
    assert!(r.loss.is_finite(), "loss {}", r.loss);
    let changed = changed_groups(&before, &packed, m);
    println!(
        "{}: one SGD step at batch 2: loss {:.4}, {:.2} s (forward {:.2} s, backward {:.2} s, \
         update {:.2} s), {} params + {} running stats written, {}/{} groups changed, {} threads",
        m.name,
        r.loss,
        total.as_secs_f64(),
        r.forward.as_secs_f64(),
        r.backward.as_secs_f64(),
        r.update.as_secs_f64(),
        r.params_updated,
        r.stats_updated,
        changed.len(),
        m.groups.len(),
        candle_core::utils::get_num_threads(),
    );
    assert_eq!(changed.len(), m.groups.len());
}
