//! `--emulate-link` and `--emulate-loopback`: the flags every process of a
//! cluster takes to run on a time-dilated clock (see
//! [`distmind_common::emulate`]), and the loopback measurement `up` and
//! `bench coldstart` choose the bucket rate from.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use distmind_common::emulate::{format_rate, parse_rate, EmulatedLink};
use distmind_common::settings::Settings;

/// The emulation flags, shared by every subcommand that starts or talks to
/// a cluster. Flags override `transport.json`'s `emulate` section.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EmulateArgs {
    /// Emulate this link rate by time dilation (e.g. 100gbit, 400gbit): every host's data path is
    /// held to --emulate-loopback and every modelled or stated time runs K = link / loopback times
    /// slower; results are reported in emulated time. Default: transport.json's `emulate`, else off.
    #[arg(long, value_name = "RATE")]
    pub emulate_link: Option<String>,
    /// The loopback rate each host's token bucket enforces under --emulate-link (e.g. 1GB/s); every
    /// process of the cluster must be given the same. Default: transport.json's `emulate`.
    #[arg(long, value_name = "RATE")]
    pub emulate_loopback: Option<String>,
}

impl EmulateArgs {
    /// The emulation in force for a process started with these flags and
    /// settings: the flags', else `transport.json`'s, else none.
    pub fn resolve(&self, settings: &Settings) -> anyhow::Result<Option<EmulatedLink>> {
        self.resolve_with(settings.transport.emulate.as_ref())
    }

    /// [`Self::resolve`] with `transport.json`'s section given directly.
    fn resolve_with(
        &self,
        from_file: Option<&distmind_common::settings::EmulateSection>,
    ) -> anyhow::Result<Option<EmulatedLink>> {
        let link = self
            .emulate_link
            .as_deref()
            .or(from_file.map(|e| e.link.as_str()));
        let loopback = self
            .emulate_loopback
            .as_deref()
            .or(from_file.map(|e| e.loopback.as_str()));
        match (link, loopback) {
            (None, None) => Ok(None),
            (Some(l), Some(r)) => EmulatedLink::parse(l, r)
                .map(Some)
                .map_err(|e| anyhow::anyhow!("--emulate-link {l} --emulate-loopback {r}: {e}")),
            (Some(l), None) => anyhow::bail!(
                "--emulate-link {l} needs --emulate-loopback (the bucket rate every process of the cluster \
                 uses, e.g. 1GB/s) or an `emulate` section in transport.json"
            ),
            (None, Some(r)) => {
                anyhow::bail!("--emulate-loopback {r} without --emulate-link: name the link rate to emulate")
            }
        }
    }

    /// Like [`Self::resolve`], but a missing loopback rate is chosen from a
    /// measurement of this machine's loopback ([`choose_loopback`]), and
    /// said so on stdout. For commands that start the whole cluster.
    pub fn resolve_measuring(
        &self,
        settings: Option<&Settings>,
        hosts: usize,
    ) -> anyhow::Result<Option<EmulatedLink>> {
        let from_file = settings.and_then(|s| s.transport.emulate.as_ref());
        let file_has_loopback = from_file.is_some();
        match (&self.emulate_link, &self.emulate_loopback) {
            (Some(link), None) if !file_has_loopback => {
                let measured = measure_loopback(LOOPBACK_PROBE)?;
                let chosen = choose_loopback(measured);
                println!(
                    "emulate: loopback measured at {} (one stream, {} ms); each host's bucket holds {} \
                     (1/{LOOPBACK_SHARE} of it, {hosts} host(s) on this machine)",
                    format_rate(measured),
                    LOOPBACK_PROBE.as_millis(),
                    format_rate(chosen)
                );
                let link_rate =
                    parse_rate(link).map_err(|e| anyhow::anyhow!("--emulate-link: {e}"))?;
                EmulatedLink::new(link_rate, chosen)
                    .map(Some)
                    .map_err(|e| anyhow::anyhow!("--emulate-link {link}: {e}"))
            }
            _ => self.resolve_with(from_file),
        }
    }

    /// The flags that give another process the same emulation.
    pub fn flags_for(link: &EmulatedLink) -> Vec<String> {
        // MB/s with f64's shortest exact form, so the rates travel unrounded.
        vec![
            "--emulate-link".into(),
            format!("{}MB/s", link.link_bytes_per_s() / 1e6),
            "--emulate-loopback".into(),
            format!("{}MB/s", link.loopback_bytes_per_s() / 1e6),
        ]
    }
}

/// `distmind bench loopback` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct LoopbackArgs {
    /// Print only the bucket rate (e.g. `1000MB/s`), for scripts that pass it to every run as
    /// --emulate-loopback so that the runs agree.
    #[arg(long)]
    pub bucket: bool,
}

/// `distmind bench loopback`.
pub fn run_loopback(args: &LoopbackArgs) -> anyhow::Result<()> {
    let measured = measure_loopback(LOOPBACK_PROBE)?;
    let chosen = choose_loopback(measured);
    if args.bucket {
        println!("{}MB/s", chosen / 1e6);
    } else {
        println!(
            "loopback: {} (one TCP stream, 4 MiB writes, {} ms); emulated links hold each host to {} \
             (1/{LOOPBACK_SHARE}, rounded down to 125 MB/s): 100gbit is K {:.2}, 400gbit K {:.2}",
            format_rate(measured),
            LOOPBACK_PROBE.as_millis(),
            format_rate(chosen),
            12.5e9 / chosen,
            50e9 / chosen
        );
    }
    Ok(())
}

/// How long the loopback probe streams.
pub const LOOPBACK_PROBE: Duration = Duration::from_millis(300);
/// The buckets run at this fraction of the measured single-stream rate:
/// the machine's cores also run the services, the clients and the
/// checksums, so the bucket, not the CPU, must be the bottleneck.
pub const LOOPBACK_SHARE: u32 = 4;
/// The bucket rate is rounded down to a multiple of this (bytes/s), so
/// that runs on one machine usually agree on it.
const LOOPBACK_ROUND: f64 = 125e6;

/// The bucket rate for a measured loopback: 1/[`LOOPBACK_SHARE`] of it,
/// rounded down to 125 MB/s steps, at least 125 MB/s. What a GPU server
/// receives is held to its own bucket, so with one GPU server the flows
/// on loopback add up to one bucket, well under the measured rate.
pub fn choose_loopback(measured_bytes_per_s: f64) -> f64 {
    let share = measured_bytes_per_s / f64::from(LOOPBACK_SHARE);
    ((share / LOOPBACK_ROUND).floor() * LOOPBACK_ROUND).max(LOOPBACK_ROUND)
}

/// Streams over a loopback TCP connection for `probe` with 4 MiB writes and
/// returns the bytes per second the reader saw.
pub fn measure_loopback(probe: Duration) -> anyhow::Result<f64> {
    const CHUNK: usize = 4 << 20;
    let listener = TcpListener::bind("127.0.0.1:0").context("loopback probe: cannot bind")?;
    let addr = listener.local_addr()?;
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut s = TcpStream::connect(addr)?;
        let buf = vec![7u8; CHUNK];
        let end = Instant::now() + probe;
        while Instant::now() < end {
            s.write_all(&buf)?;
        }
        Ok(())
    });
    let (mut s, _) = listener.accept().context("loopback probe: accept")?;
    let mut buf = vec![0u8; CHUNK];
    let start = Instant::now();
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf).context("loopback probe: read")?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("loopback probe: the writer panicked"))?
        .context("loopback probe: write")?;
    anyhow::ensure!(total > 0 && secs > 0.0, "loopback probe moved no bytes");
    Ok(total as f64 / secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_choice_is_a_rounded_quarter() {
        assert_eq!(choose_loopback(4.4e9), 1.0e9);
        assert_eq!(choose_loopback(6.0e9), 1.5e9);
        assert_eq!(choose_loopback(1.9e9), 375e6);
        // Never below one step, however slow the probe.
        assert_eq!(choose_loopback(1e8), 125e6);
    }

    #[test]
    fn flags_give_the_same_emulation() {
        let link = EmulatedLink::parse("400gbit", "1.25GB/s").unwrap();
        let flags = EmulateArgs::flags_for(&link);
        let args = EmulateArgs {
            emulate_link: Some(flags[1].clone()),
            emulate_loopback: Some(flags[3].clone()),
        };
        let back = EmulatedLink::parse(
            args.emulate_link.as_deref().unwrap(),
            args.emulate_loopback.as_deref().unwrap(),
        )
        .unwrap();
        assert_eq!(back, link);
    }

    #[test]
    fn the_probe_measures_something() {
        let r = measure_loopback(Duration::from_millis(50)).unwrap();
        assert!(r > 0.0);
    }
}
