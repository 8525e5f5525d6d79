//! Happy paths against a real server: deploy and read back, free and reuse,
//! concurrent large reads, the connection bound, clean shutdown.
mod common;

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use common::*;
use distmind_common::checksum::checksum;
use distmind_common::wire::{ReadReply, ReadRequest, ReadStatus, Role};
use std::io::Read;

#[test]
fn deploy_read_back_free_and_reuse() {
    let server = start(1 << 20);
    let mut c = server.client();
    let first = pattern(100_000, 1);
    let off = deploy(&mut c, &first, "resnet152");
    let mut d = raw(server.addr, Role::Data);
    // Whole extent, a slice inside it, and pipelined requests answered in order.
    let (r, got) = read(&mut d, 7, off, first.len() as u64);
    assert_eq!(
        (r.wr_id, r.status, r.len),
        (7, ReadStatus::Ok, first.len() as u64)
    );
    assert_eq!(got, first);
    for id in 0..3u64 {
        let (o, l) = (off + 1000 * id + 3, 4096 + id);
        d.write_all(
            &ReadRequest {
                wr_id: 100 + id,
                offset: o,
                len: l,
            }
            .encode(),
        )
        .unwrap();
    }
    for id in 0..3u64 {
        let (r, got) = read_reply(&mut d);
        assert_eq!(r.wr_id, 100 + id);
        let s = (1000 * id + 3) as usize;
        assert_eq!(got, first[s..s + 4096 + id as usize]);
    }
    // A read is counted once its reply is written, which the client can
    // see first: wait (bounded) for the last one to be counted.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let s = loop {
        let s = c.stats().unwrap();
        if s.reads_served >= 4 || std::time::Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert_eq!(s.capacity_bytes, 1 << 20);
    assert_eq!(s.used_bytes, 100_352); // rounded up to 512
    assert_eq!(s.extents, 1);
    assert_eq!(s.reads_served, 4);

    // Free, then the same space holds different bytes.
    c.free(off, "resnet152").unwrap();
    let (r, _) = read(&mut d, 8, off, 10);
    assert_eq!(r.status, ReadStatus::OutOfRange);
    let second = pattern(100_000, 2);
    let off2 = deploy(&mut c, &second, "gpt2");
    assert_eq!(off2, off, "best fit reuses the freed range");
    let (r, got) = read(&mut d, 9, off2, second.len() as u64);
    assert_eq!(r.status, ReadStatus::Ok);
    assert_eq!(got, second);
    assert_eq!(c.stats().unwrap().used_bytes, 100_352);
}

/// Two readers pull 64 MiB each. Each reads its first MiB, then waits until
/// the other has started too: a server that served one transfer behind the
/// other would never let the second start, and the wait would time out.
#[test]
fn two_large_reads_proceed_concurrently() {
    const LEN: usize = 64 << 20;
    let server = start(130 << 20);
    let mut c = server.client();
    let offsets: Vec<(u64, u64)> = (0..2u8)
        .map(|i| {
            let data = pattern(LEN, 10 + i);
            (deploy(&mut c, &data, &format!("model{i}")), checksum(&data))
        })
        .collect();
    let started = Arc::new((Mutex::new(0u32), Condvar::new()));
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let readers: Vec<_> = offsets
        .into_iter()
        .map(|(off, sum)| {
            let (addr, started, barrier) = (server.addr, started.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut d = raw(addr, Role::Data);
                barrier.wait();
                d.write_all(
                    &ReadRequest {
                        wr_id: off,
                        offset: off,
                        len: LEN as u64,
                    }
                    .encode(),
                )
                .unwrap();
                let mut h = [0u8; 32];
                d.read_exact(&mut h).unwrap();
                assert_eq!(
                    ReadReply::decode(&h, LEN as u64).unwrap().status,
                    ReadStatus::Ok
                );
                let mut data = vec![0u8; LEN];
                d.read_exact(&mut data[..1 << 20]).unwrap();
                let (lock, cv) = &*started;
                let mut n = lock.lock().unwrap();
                *n += 1;
                cv.notify_all();
                let (n, wait) = cv.wait_timeout_while(n, TIMEOUT, |n| *n < 2).unwrap();
                let saw_other_start = !wait.timed_out() && *n == 2;
                drop(n);
                d.read_exact(&mut data[1 << 20..]).unwrap();
                let finished = Instant::now();
                assert_eq!(checksum(&data), sum, "bytes of extent {off}");
                (saw_other_start, finished)
            })
        })
        .collect();
    for r in readers {
        let (saw_other_start, _) = r.join().unwrap();
        assert!(saw_other_start, "one transfer waited behind the other");
    }
    assert_eq!(server.stats.snapshot().bytes_served, 2 * LEN as u64);
}

#[test]
fn over_the_connection_bound_is_refused_then_served_again() {
    let server = start_with(1 << 20, |c| c.max_connections = 2);
    let mut a = server.client();
    let _b = server.client();
    let third =
        distmind_memserver::MemserverClient::connect(&server.addr.to_string(), &key(), TIMEOUT);
    assert!(third.is_err(), "a third connection must be refused");
    assert!(server.stats.connections_refused() >= 1);
    assert_eq!(a.stats().unwrap().connections, 2);
    drop(a);
    // A slot frees once the server sees the close.
    let mut again = None;
    eventually("a connection slot to free", || {
        again =
            distmind_memserver::MemserverClient::connect(&server.addr.to_string(), &key(), TIMEOUT)
                .ok();
        again.is_some()
    });
    assert_eq!(again.unwrap().stats().unwrap().connections, 2);
}

#[test]
fn shutdown_stops_accepting_and_tells_idle_readers() {
    let mut server = start(1 << 20);
    let mut d = raw(server.addr, Role::Data);
    let _ctl = raw(server.addr, Role::Control);
    let addr = server.addr;
    server.shutdown();
    let (r, _) = read_reply(&mut d);
    assert_eq!(r.status, ReadStatus::ShuttingDown);
    let mut buf = [0u8; 1];
    assert_eq!(d.read(&mut buf).unwrap(), 0, "closed after telling");
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "no longer listening"
    );
}

/// An emulated link's NIC: one bucket for every connection of the server,
/// so two readers together get the rate, not twice it. A lower bound only
/// (the machine may be slower, never faster than the bucket allows).
#[test]
fn the_nic_bucket_holds_every_connection_together_to_its_rate() {
    const RATE: u64 = 20_000_000;
    let server = start_with(8 << 20, |c| c.nic_bytes_per_s = Some(RATE));
    let mut c = server.client();
    let bytes = pattern(2 << 20, 5);
    let off = deploy(&mut c, &bytes, "resnet152");
    let t0 = Instant::now();
    let readers: Vec<_> = (0..2u64)
        .map(|i| {
            let addr = server.addr;
            let want = bytes.clone();
            std::thread::spawn(move || {
                let mut d = raw(addr, Role::Data);
                for k in 0..2u64 {
                    let (r, got) = read(&mut d, 10 * i + k, off, want.len() as u64);
                    assert_eq!(r.status, ReadStatus::Ok);
                    assert_eq!(got, want);
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }
    // 8 MiB through one 20 MB/s bucket with a 10 ms burst.
    let total = 4.0 * bytes.len() as f64;
    let floor =
        total / RATE as f64 - distmind_transport::token_bucket::TOKEN_BUCKET_BURST_NS as f64 / 1e9;
    let took = t0.elapsed().as_secs_f64();
    assert!(
        took >= floor,
        "8 MiB in {took:.3} s, the bucket allows no less than {floor:.3} s"
    );
}

#[test]
fn a_zero_nic_rate_is_refused() {
    let config = {
        let mut c = distmind_memserver::MemserverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            1 << 20,
            key(),
        );
        c.huge_pages = false;
        c.nic_bytes_per_s = Some(0);
        c
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let e = rt
        .block_on(distmind_memserver::Memserver::bind(config))
        .err()
        .expect("a zero rate is refused");
    assert!(e.to_string().contains("nic_bytes_per_s is 0"), "{e}");
}
