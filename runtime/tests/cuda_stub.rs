//! The `cuda` executor where it cannot run: without the `cuda` feature every
//! entry point says how to rebuild; with it, on a machine without the NVIDIA
//! driver, `CudaExecutor::new` names the library it looked for instead of
//! panicking. Runs everywhere (no GPU needed).

use distmind_runtime::exec::cuda::{h2d_bench, pin_hook, CudaExecutor, CudaOptions};
use distmind_runtime::exec::{ExecError, ExecutorKind};

fn unavailable_why(result: Result<CudaExecutor, ExecError>) -> Option<String> {
    match result {
        Ok(_) => None,
        Err(ExecError::Unavailable { executor, why }) => {
            assert_eq!(executor, ExecutorKind::Cuda);
            Some(why)
        }
        Err(other) => panic!("expected Unavailable, got {other}"),
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_every_entry_point_says_how_to_rebuild() {
    let want = "this binary was built without the cuda feature: rebuild with --features cuda";
    let why = unavailable_why(CudaExecutor::new(0)).expect("a stub cannot open a device");
    assert_eq!(why, want);
    let why = unavailable_why(CudaExecutor::with_options(
        0,
        CudaOptions {
            sync_per_layer: true,
            ..CudaOptions::default()
        },
    ))
    .expect("a stub cannot open a device");
    assert_eq!(why, want);
    match h2d_bench(1 << 20, 1) {
        Err(ExecError::Unavailable { why, .. }) => assert_eq!(why, want),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let err = (pin_hook())(&host_buffer()).unwrap_err();
    assert_eq!(err, want);
    // The message as a user sees it.
    let shown = CudaExecutor::new(0).unwrap_err().to_string();
    assert!(
        shown.starts_with("executor cuda is not available here: "),
        "{shown}"
    );
}

fn host_buffer() -> distmind_transport::memory::HostBuffer {
    distmind_transport::memory::HostBuffer::new(4096, distmind_transport::memory::HugePages::No)
        .unwrap()
}

/// With the feature, a missing driver (this CI machine) or a missing device
/// is an error naming what was looked for, never a panic.
#[cfg(feature = "cuda")]
#[test]
fn cuda_with_the_feature_a_missing_driver_or_device_is_a_clear_error() {
    let driver_present = unavailable_why(CudaExecutor::new(0))
        .map(|why| {
            println!("CudaExecutor::new(0): {why}");
            assert!(!why.contains("built without"), "{why}");
            let names_a_library = ["libcuda", "libnvrtc", "libcublas"]
                .iter()
                .any(|lib| why.contains(lib));
            let names_the_device = why.contains("device 0");
            assert!(names_a_library || names_the_device, "{why}");
            if why.contains("libcuda") {
                // cudarc's candidate names for the driver, e.g. "libcuda.so".
                assert!(why.contains("libcuda.so"), "{why}");
                assert!(why.contains("LD_LIBRARY_PATH"), "{why}");
                assert!(why.contains("NVIDIA driver"), "{why}");
            }
            !why.contains("libcuda")
        })
        .unwrap_or(true);
    // A device index no machine has: the driver's device count, or the
    // missing driver, in the message.
    let options = CudaOptions {
        sync_per_layer: true,
        ..CudaOptions::default()
    };
    let why = unavailable_why(CudaExecutor::with_options(4096, options))
        .expect("no machine has 4097 GPUs");
    if driver_present {
        assert!(why.contains("device 4096"), "{why}");
    } else {
        assert!(why.contains("libcuda"), "{why}");
    }
    // The pin hook and the bench fail the same way without a driver.
    if !driver_present {
        let err = (pin_hook())(&host_buffer()).unwrap_err();
        assert!(err.contains("libcuda"), "{err}");
        match h2d_bench(1 << 20, 1) {
            Err(ExecError::Unavailable { why, .. }) => assert!(why.contains("libcuda"), "{why}"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}
