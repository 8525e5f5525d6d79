//! CPU priority of the threads that move bytes (transport, fetch, upload).
//!
//! On a host whose cores also compute (the `cpu` executor), compute is the
//! critical path of a cold start: the pipeline's gates make compute wait for
//! a group that has not arrived, and the bytes arrive long before compute
//! needs most of them. So the threads that move bytes run at a lower CPU
//! priority (a higher Linux nice value) there, and take the cycles compute
//! leaves idle; when compute waits on a gate, they have the cores to
//! themselves. A nice value is never lowered again (that needs privileges),
//! so a thread gets its value once, when it starts.

/// Nice value of the data-movement threads of a host that computes on its
/// own cores: weight 110 against compute's 1024 under Linux's scheduler, so
/// a fetch still gets about a tenth of a core that compute keeps busy (a
/// cold start on one device never starves behind another device's compute).
pub const DATA_THREAD_NICE_HOST_COMPUTE: i32 = 10;

/// Nice value of threads that stand for another machine on this one (a
/// bench's in-process memory servers): the lowest priority there is.
pub const NICE_OTHER_MACHINE: i32 = 19;

/// Raises the calling thread's nice value to `nice` (at most 19); a value at
/// or below the thread's own leaves it as it is. A failure is logged, not
/// returned: the thread works the same at its old priority.
pub fn lower_current_thread(nice: i32) {
    let nice = nice.min(19);
    if nice <= 0 || nice <= current_thread_nice() {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // Linux keeps the nice value per thread; `who` is the thread id.
        // SAFETY: gettid and setpriority take and return plain integers.
        let r = unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, nice)
        };
        if r != 0 {
            log::warn!(
                "cannot set this thread's nice value to {nice}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The calling thread's nice value (Linux; 0 elsewhere).
pub fn current_thread_nice() -> i32 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid takes nothing and returns an integer.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
        nice_of(tid).unwrap_or(0)
    }
    #[cfg(not(target_os = "linux"))]
    0
}

/// The nice values of this process's threads whose name (as `ps` shows it,
/// at most 15 bytes) starts with `prefix` (Linux; empty elsewhere).
pub fn threads_nice(prefix: &str) -> Vec<i32> {
    #[cfg(target_os = "linux")]
    {
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return Vec::new();
        };
        tasks
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|name| name.trim_end().starts_with(prefix))
            })
            .filter_map(|t| t.file_name().to_str()?.parse().ok())
            .filter_map(nice_of)
            .collect()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = prefix;
        Vec::new()
    }
}

#[cfg(target_os = "linux")]
fn nice_of(tid: libc::id_t) -> Option<i32> {
    // SAFETY: plain integers in and out; -1 is a valid nice value, so errno
    // tells an error apart.
    unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, tid);
        (*libc::__errno_location() == 0).then_some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_lowers_only_itself() {
        let before = current_thread_nice();
        let inside = std::thread::spawn(|| {
            lower_current_thread(DATA_THREAD_NICE_HOST_COMPUTE);
            current_thread_nice()
        })
        .join()
        .unwrap();
        assert_eq!(inside, DATA_THREAD_NICE_HOST_COMPUTE.max(before));
        assert_eq!(
            current_thread_nice(),
            before,
            "the spawning thread is unchanged"
        );
        let clamped = std::thread::spawn(|| {
            lower_current_thread(40);
            current_thread_nice()
        })
        .join()
        .unwrap();
        assert_eq!(clamped, 19);
    }
}
