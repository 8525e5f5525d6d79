//! Who computes on a device right now: the device's own worker (inference,
//! prefetches) or a training op (a stage worker's forward, backward or
//! step; an iteration of the background job).
//!
//! Inference has priority: while the device's worker waits, no training
//! op is granted the device, so a request waits for at most the one op in
//! progress, and training yields between ops. Training ops are granted
//! among themselves in whatever order the waiters wake (a stage worker and
//! a background job on one device take turns, roughly). A training wait
//! gives up when its abort flag is set (checked every
//! [`DEVICE_WAIT_POLL`]), so a stopping stage worker never hangs here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How often a waiting training op looks at its abort flag.
pub const DEVICE_WAIT_POLL: Duration = Duration::from_millis(20);

#[derive(Debug, Default)]
struct State {
    held: bool,
    /// The device's worker is waiting (inference first).
    priority_waiting: u32,
}

/// The device's exclusion. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct DeviceLock {
    state: Mutex<State>,
    changed: Condvar,
}

/// Holds the device until dropped.
#[derive(Debug)]
pub(crate) struct DeviceGuard<'a> {
    lock: &'a DeviceLock,
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        self.lock.state().held = false;
        self.lock.changed.notify_all();
    }
}

impl DeviceLock {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The device for its worker (inference, prefetch): waits only for the
    /// op in progress, ahead of every training op.
    pub fn serve(&self) -> DeviceGuard<'_> {
        let mut s = self.state();
        s.priority_waiting += 1;
        while s.held {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.priority_waiting -= 1;
        s.held = true;
        DeviceGuard { lock: self }
    }

    /// The device for one training op, once no one holds it and the
    /// device's worker does not wait for it; `None` when `abort` was set
    /// meanwhile.
    pub fn train(&self, abort: &AtomicBool) -> Option<DeviceGuard<'_>> {
        let mut s = self.state();
        loop {
            if abort.load(Ordering::Relaxed) {
                return None;
            }
            if !s.held && s.priority_waiting == 0 {
                s.held = true;
                return Some(DeviceGuard { lock: self });
            }
            s = self
                .changed
                .wait_timeout(s, DEVICE_WAIT_POLL)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::Arc;

    #[test]
    fn inference_goes_before_waiting_training_ops() {
        let lock = Arc::new(DeviceLock::default());
        let never = Arc::new(AtomicBool::new(false));
        // A training op holds the device.
        let op = lock.train(&never).unwrap();
        let (tx, rx) = mpsc::channel();
        let serving = {
            let (lock, tx) = (lock.clone(), tx.clone());
            std::thread::spawn(move || {
                let _g = lock.serve();
                tx.send("inference").unwrap();
            })
        };
        // The worker is waiting once priority_waiting shows it.
        while lock.state().priority_waiting == 0 {
            std::thread::yield_now();
        }
        let training = {
            let (lock, never, tx) = (lock.clone(), never.clone(), tx.clone());
            std::thread::spawn(move || {
                let _g = lock.train(&never).unwrap();
                tx.send("training").unwrap();
            })
        };
        drop(op);
        serving.join().unwrap();
        training.join().unwrap();
        assert_eq!(rx.recv().unwrap(), "inference");
        assert_eq!(rx.recv().unwrap(), "training");
    }

    #[test]
    fn a_training_wait_ends_when_aborted() {
        let lock = DeviceLock::default();
        let _held = lock.serve();
        let abort = AtomicBool::new(true);
        assert!(lock.train(&abort).is_none());
    }
}
