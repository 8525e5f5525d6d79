//! Who computes on a device right now: the device's own worker (inference,
//! prefetches) or a training op (a stage worker's forward, backward or
//! step; an iteration of the background job).
//!
//! Inference has priority: while the device's worker waits, no training
//! op is granted the device, so a request waits for at most the one op in
//! progress, and training yields between ops. Training ops are granted
//! among themselves in the order they asked (a queue of tickets): the one
//! that just let go cannot take the device straight back ahead of a waiter
//! that has not woken yet (a stage worker arriving while the background
//! job's iteration runs goes next). A training wait gives up when its abort
//! flag is set (checked every [`DEVICE_WAIT_POLL`]) and leaves the queue,
//! so a stopping stage worker never hangs here nor holds up the others.

use std::collections::VecDeque;
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
    /// Waiting training ops' tickets, in the order they asked; the front
    /// one is next.
    training_queue: VecDeque<u64>,
    next_ticket: u64,
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

    /// The device for one training op, once no one holds it, the device's
    /// worker does not wait for it and every training op that asked before
    /// has had its turn; `None` when `abort` was set meanwhile.
    pub fn train(&self, abort: &AtomicBool) -> Option<DeviceGuard<'_>> {
        let mut s = self.state();
        let ticket = s.next_ticket;
        s.next_ticket += 1;
        s.training_queue.push_back(ticket);
        loop {
            if abort.load(Ordering::Relaxed) {
                s.training_queue.retain(|&t| t != ticket);
                drop(s);
                // The next ticket may be free to go now.
                self.changed.notify_all();
                return None;
            }
            if !s.held && s.priority_waiting == 0 && s.training_queue.front() == Some(&ticket) {
                s.training_queue.pop_front();
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
        assert!(lock.state().training_queue.is_empty());
    }

    /// Blocks until `n` training ops wait for the device.
    fn until_waiting(lock: &DeviceLock, n: usize) {
        while lock.state().training_queue.len() < n {
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_training_op_that_lets_go_cannot_take_the_device_back_ahead_of_a_waiter() {
        // The background job's loop: hold, let go, ask again at once. A
        // stage worker that asked meanwhile goes first.
        let lock = Arc::new(DeviceLock::default());
        let never = Arc::new(AtomicBool::new(false));
        let op = lock.train(&never).unwrap();
        let (tx, rx) = mpsc::channel();
        let stage = {
            let (lock, never, tx) = (lock.clone(), never.clone(), tx.clone());
            std::thread::spawn(move || {
                let _g = lock.train(&never).unwrap();
                tx.send("stage worker").unwrap();
            })
        };
        until_waiting(&lock, 1);
        drop(op);
        let again = lock.train(&never).unwrap();
        tx.send("background job").unwrap();
        drop(again);
        stage.join().unwrap();
        assert_eq!(rx.recv().unwrap(), "stage worker");
        assert_eq!(rx.recv().unwrap(), "background job");
    }

    #[test]
    fn an_aborted_wait_leaves_the_queue_and_the_next_goes() {
        let lock = Arc::new(DeviceLock::default());
        let never = Arc::new(AtomicBool::new(false));
        let op = lock.train(&never).unwrap();
        let abort = Arc::new(AtomicBool::new(false));
        let first = {
            let (lock, abort) = (lock.clone(), abort.clone());
            std::thread::spawn(move || lock.train(&abort).is_none())
        };
        until_waiting(&lock, 1);
        let second = {
            let (lock, never) = (lock.clone(), never.clone());
            std::thread::spawn(move || lock.train(&never).is_some())
        };
        until_waiting(&lock, 2);
        abort.store(true, Ordering::Relaxed);
        assert!(first.join().unwrap(), "the aborted wait returned None");
        drop(op);
        assert!(second.join().unwrap(), "the next in line got the device");
        assert!(lock.state().training_queue.is_empty());
    }
}
