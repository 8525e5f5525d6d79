//! One operation's data phase: the chunk schedule, and the steps that
//! send segments through a sender thread while receiving on the caller's.

use std::io::{self, Read};
use std::net::TcpStream;
use std::ops::Range;

use crossbeam::channel::{Receiver, Sender};

use super::frame::{read_header, EdgeError, FrameHeader, DATA_TAG, RING_FRAME_HEADER_BYTES};
use super::{InjectedFault, Op};
use crate::dist::limits::RING_SEGMENT_ELEMENTS;
use crate::dist::tensor::{f32s_to_le, le_to_f32s};

/// Chunk `c` of `n` over `len` elements.
pub fn chunk_range(len: usize, n: usize, c: usize) -> Range<usize> {
    debug_assert!(c < n);
    let at = |i: usize| (i as u128 * len as u128 / n as u128) as usize;
    at(c)..at(c + 1)
}

/// Reduce-scatter step `s` for rank `r` of `n`: (chunk sent, chunk received).
pub(super) fn reduce_scatter_chunks(r: usize, s: usize, n: usize) -> (usize, usize) {
    ((r + n - s) % n, (r + 2 * n - s - 1) % n)
}

/// All-gather step `s` for rank `r` of `n`: (chunk sent, chunk received).
pub(super) fn all_gather_chunks(r: usize, s: usize, n: usize) -> (usize, usize) {
    ((r + 1 + n - s) % n, (r + n - s) % n)
}

/// The chunk rank `r` owns (sums and divides) after reduce-scatter.
pub(super) fn owned_chunk(r: usize, n: usize) -> usize {
    (r + 1) % n
}

/// How received values meet the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Combine {
    /// `buf = received + buf` (reduce-scatter).
    Add,
    /// `buf = received` (all-gather, broadcast).
    Copy,
}

/// The sender thread's two channels and the frames the caller holds.
pub(super) struct Pipe<'a> {
    pub(super) to_writer: Option<Sender<Vec<u8>>>,
    pub(super) from_writer: Receiver<io::Result<Vec<u8>>>,
    pub(super) free: Vec<Vec<u8>>,
    pub(super) outstanding: usize,
    pub(super) segments_sent: u64,
    pub(super) fault: Option<InjectedFault>,
    /// `seq` of the next edge (frames sent) and of the prev edge (received).
    pub(super) send_seq: u64,
    pub(super) recv_seq: u64,
    pub(super) op: Op,
    pub(super) recv_scratch: &'a mut Vec<u8>,
}

/// Why a data phase stopped, and on which edge.
pub(super) enum PhaseError {
    Next(EdgeError),
    Prev(EdgeError),
    Injected(InjectedFault),
}

impl Pipe<'_> {
    pub(super) fn reclaim(&mut self, block: bool) -> Result<(), PhaseError> {
        loop {
            let got = if block {
                self.from_writer.recv().ok()
            } else {
                self.from_writer.try_recv().ok()
            };
            match got {
                Some(Ok(b)) => {
                    self.outstanding -= 1;
                    self.free.push(b);
                    if block {
                        return Ok(());
                    }
                }
                Some(Err(e)) => return Err(PhaseError::Next(e.into())),
                None if block => {
                    return Err(PhaseError::Next(EdgeError::Closed {
                        reset: false,
                        detail: "sender thread stopped".into(),
                    }))
                }
                None => return Ok(()),
            }
        }
    }

    fn hand(&mut self, step: u64, at: usize, values: &[f32]) -> Result<(), PhaseError> {
        let mut b = self.free.pop().expect("a free frame");
        b.clear();
        b.extend_from_slice(
            &FrameHeader {
                tag: DATA_TAG,
                op: self.op as u16,
                seq: self.send_seq,
                a: step,
                b: at as u64,
                c: values.len() as u64,
            }
            .encode(),
        );
        b.resize(RING_FRAME_HEADER_BYTES + values.len() * 4, 0);
        f32s_to_le(values, &mut b[RING_FRAME_HEADER_BYTES..]);
        let tx = self.to_writer.as_ref().expect("open during the phase");
        if tx.send(b).is_err() {
            return Err(PhaseError::Next(EdgeError::Closed {
                reset: false,
                detail: "sender thread stopped".into(),
            }));
        }
        self.outstanding += 1;
        self.segments_sent += 1;
        if let Some(f @ InjectedFault::DieAfterSegments(k)) = self.fault {
            if self.segments_sent >= k {
                return Err(PhaseError::Injected(f));
            }
        }
        Ok(())
    }

    fn receive(
        &mut self,
        prev: &mut TcpStream,
        step: u64,
        at: usize,
        dst: &mut [f32],
        combine: Combine,
    ) -> Result<(), PhaseError> {
        let want = FrameHeader {
            tag: DATA_TAG,
            op: self.op as u16,
            seq: self.recv_seq,
            a: step,
            b: at as u64,
            c: dst.len() as u64,
        };
        let h = read_header(prev).map_err(PhaseError::Prev)?;
        h.expect(&want)
            .map_err(|d| PhaseError::Prev(EdgeError::Protocol(d)))?;
        // Sized by what we expect, never by the peer: at most one segment.
        self.recv_scratch.resize(dst.len() * 4, 0);
        prev.read_exact(self.recv_scratch)
            .map_err(|e| PhaseError::Prev(e.into()))?;
        match combine {
            Combine::Copy => le_to_f32s(self.recv_scratch, dst),
            Combine::Add => {
                for (d, s) in dst.iter_mut().zip(self.recv_scratch.chunks_exact(4)) {
                    *d += f32::from_le_bytes(s.try_into().expect("4 bytes"));
                }
            }
        }
        Ok(())
    }

    /// One step: send `send` (if any) while receiving into `recv` (if any);
    /// with `forward`, `send` is `recv`'s range and each segment goes on
    /// once it has arrived.
    fn step(
        &mut self,
        prev: &mut TcpStream,
        buf: &mut [f32],
        step: u64,
        send: Option<Range<usize>>,
        recv: Option<(Range<usize>, Combine)>,
        forward: bool,
    ) -> Result<(), PhaseError> {
        let segments = |r: &Range<usize>| r.len().div_ceil(RING_SEGMENT_ELEMENTS);
        let seg = |r: &Range<usize>, i: usize| {
            let start = r.start + i * RING_SEGMENT_ELEMENTS;
            start..(start + RING_SEGMENT_ELEMENTS).min(r.end)
        };
        let (send_n, recv_n) = (
            send.as_ref().map_or(0, segments),
            recv.as_ref().map_or(0, |(r, _)| segments(r)),
        );
        let (mut si, mut ri) = (0, 0);
        while si < send_n || ri < recv_n {
            self.reclaim(false)?;
            let may_send = si < send_n && (!forward || si < ri);
            if may_send && !self.free.is_empty() {
                let r = seg(send.as_ref().expect("sending"), si);
                self.hand(step, r.start, &buf[r.clone()])?;
                si += 1;
            } else if ri < recv_n {
                let (range, combine) = recv.as_ref().expect("receiving");
                let r = seg(range, ri);
                self.receive(prev, step, r.start, &mut buf[r], *combine)?;
                ri += 1;
            } else {
                self.reclaim(true)?;
            }
        }
        Ok(())
    }
}

pub(super) fn all_reduce_steps(
    pipe: &mut Pipe,
    prev: &mut TcpStream,
    buf: &mut [f32],
    n: usize,
    r: usize,
    len: usize,
) -> Result<(), PhaseError> {
    let chunk = |c| chunk_range(len, n, c);
    for s in 0..n - 1 {
        let (send, recv) = reduce_scatter_chunks(r, s, n);
        pipe.step(
            prev,
            buf,
            s as u64,
            Some(chunk(send)),
            Some((chunk(recv), Combine::Add)),
            false,
        )?;
    }
    let n_f32 = n as f32;
    for v in &mut buf[chunk(owned_chunk(r, n))] {
        *v /= n_f32;
    }
    for s in 0..n - 1 {
        let (send, recv) = all_gather_chunks(r, s, n);
        let step = (n - 1 + s) as u64;
        pipe.step(
            prev,
            buf,
            step,
            Some(chunk(send)),
            Some((chunk(recv), Combine::Copy)),
            false,
        )?;
    }
    Ok(())
}

pub(super) fn broadcast_steps(
    pipe: &mut Pipe,
    prev: &mut TcpStream,
    buf: &mut [f32],
    n: usize,
    r: usize,
    root: usize,
) -> Result<(), PhaseError> {
    let all = 0..buf.len();
    let d = (r + n - root) % n;
    let (send, recv) = match d {
        0 => (Some(all), None),
        _ if d == n - 1 => (None, Some((all, Combine::Copy))),
        _ => (Some(all.clone()), Some((all, Combine::Copy))),
    };
    let forward = d != 0 && d != n - 1;
    pipe.step(prev, buf, 0, send, recv, forward)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schedule, run on vectors instead of sockets: every member ends
    /// with the same bits, equal to the chunk sums in ring order / n.
    fn simulate(inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let n = inputs.len();
        let len = inputs[0].len();
        let mut bufs = inputs.to_vec();
        for s in 0..n - 1 {
            let sent: Vec<(usize, Vec<f32>)> = (0..n)
                .map(|r| {
                    let c = reduce_scatter_chunks(r, s, n).0;
                    (c, bufs[r][chunk_range(len, n, c)].to_vec())
                })
                .collect();
            for r in 0..n {
                let (c, data) = &sent[(r + n - 1) % n];
                assert_eq!(*c, reduce_scatter_chunks(r, s, n).1);
                for (d, v) in bufs[r][chunk_range(len, n, *c)].iter_mut().zip(data) {
                    *d += v;
                }
            }
        }
        for (r, b) in bufs.iter_mut().enumerate() {
            for v in &mut b[chunk_range(len, n, owned_chunk(r, n))] {
                *v /= n as f32;
            }
        }
        for s in 0..n - 1 {
            let sent: Vec<(usize, Vec<f32>)> = (0..n)
                .map(|r| {
                    let c = all_gather_chunks(r, s, n).0;
                    (c, bufs[r][chunk_range(len, n, c)].to_vec())
                })
                .collect();
            for r in 0..n {
                let (c, data) = &sent[(r + n - 1) % n];
                assert_eq!(*c, all_gather_chunks(r, s, n).1);
                bufs[r][chunk_range(len, n, *c)].copy_from_slice(data);
            }
        }
        bufs
    }

    #[test]
    fn the_schedule_sums_each_chunk_once_in_ring_order() {
        for n in 2..=6 {
            for len in [0, 1, 5, 7, 13] {
                let inputs: Vec<Vec<f32>> = (0..n)
                    .map(|m| (0..len).map(|j| 0.1 * (m * 31 + j) as f32 + 1e-3).collect())
                    .collect();
                let out = simulate(&inputs);
                for c in 0..n {
                    for j in chunk_range(len, n, c) {
                        let mut sum = inputs[c][j];
                        for k in 1..n {
                            sum += inputs[(c + k) % n][j];
                        }
                        let mean = sum / n as f32;
                        for o in &out {
                            assert_eq!(o[j].to_bits(), mean.to_bits(), "n={n} len={len} j={j}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn chunks_cover_the_buffer_for_any_length() {
        for n in 1..=7 {
            for len in [0, 1, 2, 6, 7, 8, 1000, 1_000_003] {
                let mut at = 0;
                for c in 0..n {
                    let r = chunk_range(len, n, c);
                    assert_eq!(r.start, at);
                    assert!(r.len() == len / n || r.len() == len / n + 1);
                    at = r.end;
                }
                assert_eq!(at, len);
            }
        }
    }
}
