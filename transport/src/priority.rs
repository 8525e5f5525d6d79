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

/// Nice value of the upload stage's threads on such a host: between
/// compute's 0 and the transport's [`DATA_THREAD_NICE_HOST_COMPUTE`]
/// (weight 335 against 110), because the upload is the stage nearer
/// compute, and a group that arrived should reach compute before the next
/// one is received (drain the pipeline before filling it). On a 2-core VM,
/// five interleaved pairs of `bench coldstart --executor cpu --family
/// bert_base,gpt2 --trace`: GPT-2's first layer started 7-43 ms earlier in
/// every pair (mean 117 ms against 137) than with the upload at 10.
pub const UPLOAD_THREAD_NICE_HOST_COMPUTE: i32 = 5;

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

/// Sets the calling thread's timer slack to 1 ns, once per thread (Linux;
/// nothing elsewhere). By default Linux may fire a thread's sleep up to
/// 50 us late to batch wakeups; a thread that stands for a device's clock
/// (the `sim` executor's) must wake when its kernel or copy would end.
/// A failure is logged once: the thread works the same, only less precisely.
pub fn tighten_timer_slack() {
    thread_local!(static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    if DONE.with(|d| d.replace(true)) {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl(PR_SET_TIMERSLACK) takes plain integers and changes
        // only the calling thread's slack.
        let r = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
        if r != 0 {
            log::warn!(
                "cannot set this thread's timer slack: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The calling thread's timer slack in ns (Linux; `None` elsewhere or if
/// it cannot be read).
pub fn current_timer_slack_ns() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl(PR_GET_TIMERSLACK) takes no pointer.
        let r = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
        (r >= 0).then_some(r as u64)
    }
    #[cfg(not(target_os = "linux"))]
    None
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
        threads_named(prefix)
            .into_iter()
            .filter_map(|(tid, _)| nice_of(tid))
            .collect()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = prefix;
        Vec::new()
    }
}

/// CPU time that this process's threads whose name starts with `prefix`
/// have used so far (Linux, from each thread's `schedstat`; zero
/// elsewhere). A thread that has exited no longer counts.
pub fn threads_cpu_time(prefix: &str) -> std::time::Duration {
    #[cfg(target_os = "linux")]
    {
        let ns: u64 = threads_named(prefix)
            .into_iter()
            .filter_map(|(_, dir)| {
                let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
                stat.split_whitespace().next()?.parse::<u64>().ok()
            })
            .sum();
        std::time::Duration::from_nanos(ns)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = prefix;
        std::time::Duration::ZERO
    }
}

/// This process's threads whose name starts with `prefix`: id and
/// `/proc/self/task` entry.
#[cfg(target_os = "linux")]
fn threads_named(prefix: &str) -> Vec<(libc::id_t, std::path::PathBuf)> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|name| name.trim_end().starts_with(prefix))
        })
        .filter_map(|t| Some((t.file_name().to_str()?.parse().ok()?, t.path())))
        .collect()
}

/// CPU time that every thread of this process has used so far, user and
/// system (`CLOCK_PROCESS_CPUTIME_ID`; zero where the clock is missing).
/// Over a run, divided by the run's wall time and the host's cores, it
/// says how busy the run kept the host.
pub fn process_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// CPU time (user and system) process `pid` has used so far, from
/// `/proc/<pid>/stat` (Linux; `None` elsewhere or when it is gone).
pub fn pid_cpu_time(pid: u32) -> Option<std::time::Duration> {
    let fields = proc_stat_fields(pid)?;
    // utime and stime are fields 14 and 15 of the line.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf takes and returns plain integers.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| std::time::Duration::from_secs_f64((utime + stime) as f64 / hz as f64))
}

/// The fields of process `pid`'s `/proc/<pid>/stat` line from field 3 on
/// (index 0 is field 3, its state), or `None` when it cannot be read
/// (no such process, not Linux). The command name, field 2, is in
/// parentheses and may hold blanks and parentheses itself, so the fields
/// count from the last ')'.
pub fn proc_stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// The host's CPU time so far over every core, as (busy, total) in clock
/// ticks, from `/proc/stat` (Linux; `None` elsewhere). Idle and I/O wait
/// are not busy; steal (another guest ran) is.
pub fn host_cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 5 {
        return None;
    }
    let total: u64 = v.iter().sum();
    Some((total - v[3] - v[4], total))
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

    #[test]
    fn timer_slack_is_tightened_for_the_calling_thread_only() {
        let before = current_timer_slack_ns();
        let inside = std::thread::spawn(|| {
            tighten_timer_slack();
            tighten_timer_slack();
            current_timer_slack_ns()
        })
        .join()
        .unwrap();
        if cfg!(target_os = "linux") {
            assert_eq!(inside, Some(1));
        }
        assert_eq!(
            current_timer_slack_ns(),
            before,
            "the spawning thread is unchanged"
        );
    }

    #[test]
    fn cpu_time_of_a_pid_and_of_the_host_move_with_work() {
        let me = std::process::id();
        let before = pid_cpu_time(me).expect("this process's /proc stat");
        let (busy0, total0) = host_cpu_ticks().expect("/proc/stat");
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(60) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(x > 0);
        assert!(pid_cpu_time(me).unwrap() > before);
        let (busy1, total1) = host_cpu_ticks().unwrap();
        assert!(busy1 > busy0 && total1 > total0 && busy1 - busy0 <= total1 - total0);
        assert_eq!(pid_cpu_time(u32::MAX), None, "no such process");
        // A running process's state (field 3) leads its fields; a line has
        // 52 fields since Linux 3.5, so 50 from field 3 on.
        let f = proc_stat_fields(me).unwrap();
        assert!(matches!(f[0].as_str(), "R" | "S"), "{f:?}");
        assert!(f.len() >= 50, "{f:?}");
    }

    #[test]
    fn process_cpu_time_counts_every_thread() {
        let thread_cpu = || {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `ts` is a valid, writable timespec for the call.
            assert_eq!(
                unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) },
                0
            );
            std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
        };
        let before = process_cpu_time();
        // Another thread burns 20 ms of its own CPU time while this one
        // waits: a clock of this thread alone would barely move.
        let named_before = threads_cpu_time("cpu-time-test");
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let (burnt_tx, burnt_rx) = std::sync::mpsc::channel::<()>();
        let burner = std::thread::Builder::new()
            .name("cpu-time-test".into())
            .spawn(move || {
                let start = thread_cpu();
                let mut x = 0u64;
                while thread_cpu() - start < std::time::Duration::from_millis(20) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                // Stay alive (and named) until the test has read its time.
                burnt_tx.send(()).unwrap();
                let _ = done_rx.recv();
            })
            .unwrap();
        burnt_rx.recv().unwrap();
        let named = threads_cpu_time("cpu-time-test") - named_before;
        let other = threads_cpu_time("no thread is called this");
        done_tx.send(()).unwrap();
        burner.join().unwrap();
        let used = process_cpu_time() - before;
        assert!(used >= std::time::Duration::from_millis(20), "{used:?}");
        assert!(named >= std::time::Duration::from_millis(20), "{named:?}");
        assert_eq!(other, std::time::Duration::ZERO);
    }
}
