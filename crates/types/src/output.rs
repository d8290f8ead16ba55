//! What a sans-IO protocol connection has to send: encoded bytes with data buffers spliced in
//! between them, so a read's data goes to the socket from the buffer it was read into instead of
//! being copied behind its header. The driver sends [`SpliceOutput::chunks`] in order (one
//! vectored write) and reports what the socket took with [`SpliceOutput::consume`]; a buffer
//! whose pieces have all been sent comes back through [`SpliceOutput::take_released`].

use std::collections::VecDeque;
use std::ops::Range;

use crate::AlignedBuf;

/// Bytes of sent output kept at the front before they are compacted away.
const COMPACT_BYTES: usize = 256 * 1024;
/// Capacity the byte queue keeps once drained, so an idle connection does not hold a burst's.
const CAPACITY_RETAINED_BYTES: usize = 4 << 20;

/// Output bytes and spliced buffer pieces, in stream order.
#[derive(Default)]
pub struct SpliceOutput {
    /// Encoded bytes; those before `start` are sent.
    bytes: Vec<u8>,
    start: usize,
    /// Buffer pieces in stream order: each goes out after `bytes[..at]`. `at` never decreases
    /// along the queue, and the front's is at least `start`.
    splices: VecDeque<Splice>,
    /// The buffers the splices send from, in the order they were pushed; the front one is
    /// `first_buffer`.
    buffers: VecDeque<Held>,
    first_buffer: u64,
    /// Bytes of `splices` not yet sent.
    spliced_pending: usize,
    /// Buffers whose pieces are all sent, for the owner to reuse.
    released: Vec<AlignedBuf>,
}

struct Splice {
    at: usize,
    buffer: u64,
    /// What is left to send of the piece.
    range: Range<usize>,
}

struct Held {
    buf: AlignedBuf,
    pieces_pending: usize,
}

/// Where [`SpliceOutput::push_buffer`]'s `frame` is called for a piece: to encode what goes
/// before its data, or after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceSide {
    Before,
    After,
}

impl SpliceOutput {
    pub fn new() -> Self {
        Self::default()
    }

    /// The encoded bytes, to append to (an encoder writes at the end). Bytes already there must
    /// not be changed: some may be sent.
    pub fn bytes_mut(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }

    /// Hands `buf` over to be sent in `pieces` (ranges of it, non-empty, in stream order): for
    /// each, `frame(bytes, range, piece data, Before)` encodes what precedes it, then the piece
    /// is spliced in, then `frame(bytes, range, piece data, After)` encodes what follows it.
    /// The buffer comes back through [`SpliceOutput::take_released`] once every piece is sent
    /// (at once if there are none).
    pub fn push_buffer(
        &mut self,
        buf: AlignedBuf,
        pieces: impl Iterator<Item = Range<usize>>,
        mut frame: impl FnMut(&mut Vec<u8>, Range<usize>, &[u8], PieceSide),
    ) {
        let id = self.first_buffer + self.buffers.len() as u64;
        let mut count = 0;
        for range in pieces {
            assert!(
                range.start < range.end && range.end <= buf.len(),
                "a spliced piece is a non-empty range of its buffer"
            );
            frame(&mut self.bytes, range.clone(), &buf[range.clone()], PieceSide::Before);
            self.spliced_pending += range.len();
            let at = self.bytes.len();
            self.splices.push_back(Splice { at, buffer: id, range: range.clone() });
            frame(&mut self.bytes, range.clone(), &buf[range], PieceSide::After);
            count += 1;
        }
        if count == 0 {
            self.released.push(buf);
        } else {
            self.buffers.push_back(Held { buf, pieces_pending: count });
        }
    }

    /// Bytes waiting to be sent: the sum of [`SpliceOutput::chunks`]' lengths.
    pub fn len(&self) -> usize {
        self.bytes.len() - self.start + self.spliced_pending
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes waiting to be sent, as chunks to send in this order (none is empty).
    pub fn chunks(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let mut position = self.start;
        let mut splices = self.splices.iter().peekable();
        std::iter::from_fn(move || match splices.peek() {
            Some(next) if next.at == position => splices.next().map(|splice| self.piece(splice)),
            Some(next) => {
                let chunk = &self.bytes[position..next.at];
                position = next.at;
                Some(chunk)
            }
            None if position < self.bytes.len() => {
                let chunk = &self.bytes[position..];
                position = self.bytes.len();
                Some(chunk)
            }
            None => None,
        })
    }

    fn piece(&self, splice: &Splice) -> &[u8] {
        let held = usize::try_from(splice.buffer - self.first_buffer).unwrap_or(usize::MAX);
        &self.buffers[held].buf[splice.range.clone()]
    }

    /// Drops the first `length` bytes of [`SpliceOutput::chunks`], which the socket took.
    pub fn consume(&mut self, length: usize) {
        assert!(length <= self.len(), "consumed more than pending");
        let mut left = length;
        // Each pass takes at least one byte of `left`.
        while left > 0 {
            match self.splices.front_mut() {
                Some(front) if front.at == self.start => {
                    let taken = left.min(front.range.len());
                    front.range.start += taken;
                    left -= taken;
                    self.spliced_pending -= taken;
                    if front.range.is_empty() {
                        self.splices.pop_front();
                        self.piece_sent();
                    }
                }
                Some(front) => {
                    let taken = left.min(front.at - self.start);
                    self.start += taken;
                    left -= taken;
                }
                None => {
                    self.start += left;
                    left = 0;
                }
            }
        }
        if self.start == self.bytes.len() {
            // What is left spliced goes out next: it now sits at the start.
            for splice in &mut self.splices {
                splice.at = 0;
            }
            self.bytes.clear();
            self.start = 0;
            if self.bytes.capacity() > CAPACITY_RETAINED_BYTES {
                self.bytes.shrink_to(CAPACITY_RETAINED_BYTES);
            }
        } else if self.start >= COMPACT_BYTES && self.start * 2 >= self.bytes.len() {
            self.bytes.drain(..self.start);
            for splice in &mut self.splices {
                splice.at -= self.start;
            }
            self.start = 0;
        }
    }

    /// One piece of the front buffer is sent (pieces go out in buffer order).
    fn piece_sent(&mut self) {
        let front = self.buffers.front_mut().expect("a spliced piece has its buffer");
        front.pieces_pending -= 1;
        if front.pieces_pending == 0 {
            if let Some(held) = self.buffers.pop_front() {
                self.released.push(held.buf);
            }
            self.first_buffer += 1;
        }
    }

    /// A buffer whose pieces have all been sent, if any.
    pub fn take_released(&mut self) -> Option<AlignedBuf> {
        self.released.pop()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(fill: u8, length: usize) -> AlignedBuf {
        let mut buf = AlignedBuf::new(length);
        buf.fill(fill);
        buf
    }

    /// Builds one stream: bytes, a buffer in three framed pieces, bytes, a whole buffer, an
    /// empty one; returns the output and the bytes it must send.
    fn sample() -> (SpliceOutput, Vec<u8>) {
        let mut output = SpliceOutput::new();
        let mut expected = Vec::new();
        output.bytes_mut().extend_from_slice(b"hello");
        expected.extend_from_slice(b"hello");
        let first = buffer(1, 12288);
        let pieces = [0..5000, 5000..5001, 5001..12288];
        output.push_buffer(first, pieces.iter().cloned(), |bytes, range, data, side| {
            assert_eq!(range.len(), data.len());
            let mark = if side == PieceSide::Before { b'<' } else { b'>' };
            bytes.extend_from_slice(&[mark, data.len() as u8]);
        });
        for piece in &pieces {
            expected.extend_from_slice(&[b'<', piece.len() as u8]);
            expected.extend(std::iter::repeat_n(1u8, piece.len()));
            expected.extend_from_slice(&[b'>', piece.len() as u8]);
        }
        output.bytes_mut().extend_from_slice(b"mid");
        expected.extend_from_slice(b"mid");
        output.push_buffer(buffer(2, 4096), std::iter::once(0..4096), |_, _, _, _| {});
        expected.extend(std::iter::repeat_n(2u8, 4096));
        output.push_buffer(buffer(3, 4096), std::iter::empty(), |_, _, _, _| {});
        (output, expected)
    }

    #[test]
    fn every_split_of_the_sends_gives_the_stream_and_releases_each_buffer_once_sent() {
        for step in [1, 2, 3, 7, 4095, 4096, 5003, 100_000] {
            let (mut output, expected) = sample();
            assert_eq!(output.len(), expected.len());
            // The empty buffer is released at once; the others only once sent.
            assert!(output.take_released().is_some_and(|buf| buf[0] == 3));
            let mut sent = Vec::new();
            let mut released = Vec::new();
            while !output.is_empty() {
                assert!(output.chunks().all(|chunk| !chunk.is_empty()));
                let total: usize = output.chunks().map(<[u8]>::len).sum();
                assert_eq!(total, output.len());
                let next: Vec<u8> = output.chunks().flatten().take(step).copied().collect();
                sent.extend_from_slice(&next);
                output.consume(next.len());
                while let Some(buf) = output.take_released() {
                    released.push((buf[0], sent.len()));
                }
            }
            assert!(sent == expected, "step {step}: the streams differ");
            assert_eq!(output.chunks().count(), 0);
            // Each buffer came back once, no earlier than its last byte was sent.
            // The first buffer's last byte: "hello", its data and the marks before the last.
            let ends = [(1u8, 5 + 3 * 4 - 2 + 12288), (2u8, expected.len())];
            assert_eq!(released.len(), 2, "step {step}");
            released.sort_unstable();
            for ((fill, at), (want_fill, last_byte)) in released.iter().zip(ends) {
                assert_eq!(*fill, want_fill);
                assert!(*at >= last_byte, "step {step}: buffer {fill} released at {at}");
            }
        }
    }

    #[test]
    fn bytes_added_while_a_piece_is_half_sent_follow_it() {
        let mut output = SpliceOutput::new();
        output.bytes_mut().extend_from_slice(b"ab");
        output.push_buffer(buffer(9, 4096), std::iter::once(0..4096), |_, _, _, _| {});
        output.consume(1000);
        output.bytes_mut().extend_from_slice(b"cd");
        let rest: Vec<u8> = output.chunks().flatten().copied().collect();
        // 1000 bytes sent: "ab" and 998 of the buffer's.
        assert_eq!(rest.len(), 4096 - 998 + 2);
        assert!(rest[..3098].iter().all(|byte| *byte == 9));
        assert_eq!(&rest[3098..], b"cd");
        output.consume(rest.len());
        assert!(output.is_empty());
        assert!(output.take_released().is_some());
    }

    #[test]
    #[should_panic(expected = "consumed more than pending")]
    fn consuming_more_than_pending_is_a_driver_bug() {
        let mut output = SpliceOutput::new();
        output.bytes_mut().extend_from_slice(b"ab");
        output.consume(3);
    }
}
