//! `TcpCollective`: the CPU implementation of [`Collective`] over blocking `std::net` TCP, one
//! connection per pair of ranks, so tensor- and pipeline-parallel runs work multi-process (and
//! in CI) without GPUs or NCCL.
//!
//! Setup: rank r dials ranks 0..r in order, then accepts ranks r+1..world. Rank 0 only accepts,
//! and a rank starts accepting as soon as every lower rank accepts, so this cannot deadlock.
//! Each connection opens with a hello from both ends (magic, version, group, world, from rank,
//! to rank) and the acceptor's verdict byte. An acceptor drops a connection whose hello does not
//! fit (stray bytes, another group, another world size, a duplicate rank) and keeps waiting;
//! the dialer fails at once with the reason. Everything finishes within `timeout` or fails.
//!
//! Wire format, little-endian. Every message is a frame
//!   `tag u8 | seq u64 | count u64 | count elements of 4 bytes`
//! where `seq` counts the operations on that connection. Both ends of a link agree on it
//! whenever they agree on the order of operations, so a frame whose tag, seq or count differs
//! from what the reader expects is a `Mismatch` (another op, another length, a skipped op).
//! A count above `MAX_FRAME_BYTES` is refused before anything is allocated.
//!
//! Collectives form a star on rank 0: every rank sends its data to rank 0, which adds the
//! contributions in rank order (((x0 + x1) + x2) ...) as they arrive and sends the result back,
//! so every rank holds the same bits whatever the timing. Rank 0 moves 2(world-1) payloads
//! per call, which is fine for the 2-4 rank groups CPU workers run; a ring would spread the
//! load for larger groups but needs a fixed reduction order to keep the same guarantee.
//!
//! Failure is fail-stop. The first error (other than `InvalidArgument`) breaks the collective:
//! it writes an abort frame (kind + reason) to every peer it can still write whole frames to
//! and shuts its connections for writing, so peers fail on their next read from this rank
//! instead of waiting for `op_timeout`; a mismatch is thereby reported as `Mismatch` on every
//! rank. Later calls return `Broken`. `op_timeout` is set as the sockets' read and write
//! timeouts: a call fails with `Timeout` when a peer makes no progress for that long.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::{Collective, CollectiveError};

/// First bytes of every hello: a stray connection is recognised before anything is trusted.
const MAGIC: [u8; 8] = *b"TESSCOLL";
/// Wire version; bump on any change to the hello or frame layout.
const VERSION: u32 = 1;
/// magic 8 | version u32 | group u64 | world u64 | from rank u64 | to rank u64
const HELLO_LEN: usize = 44;
/// tag u8 | seq u64 | count u64
const HEADER_LEN: usize = 17;
/// Largest payload one frame may carry (1 GiB).
pub const MAX_FRAME_BYTES: usize = 1 << 30;
/// Abort payload: kind byte + UTF-8 reason, at most this many bytes.
const MAX_ABORT_BYTES: usize = 4096;
/// Payloads are read in steps of this size, so memory grows only with bytes actually received.
const READ_STEP: usize = 4 << 20;
const CONNECT_RETRY: Duration = Duration::from_millis(20);
const ACCEPT_POLL: Duration = Duration::from_millis(2);
/// Bound on writing an abort frame: a peer that stopped reading must not delay our failure.
const ABORT_WRITE_TIMEOUT: Duration = Duration::from_millis(100);

const ABORT_MISMATCH: u8 = 1;
const ABORT_FAILED: u8 = 2;

/// Acceptor verdicts, sent after its hello.
const ACCEPTED: u8 = 0;
const REJECT_VERSION: u8 = 1;
const REJECT_GROUP: u8 = 2;
const REJECT_WORLD: u8 = 3;
const REJECT_RANK: u8 = 4;
const REJECT_DUPLICATE: u8 = 5;

/// What a frame carries; the same tag flows both ways of an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tag {
    AllReduceSum = 1,
    AllGather = 2,
    Barrier = 3,
    F32 = 4,
    U32 = 5,
    Abort = 0xFF,
}

impl Tag {
    fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::AllReduceSum),
            2 => Some(Self::AllGather),
            3 => Some(Self::Barrier),
            4 => Some(Self::F32),
            5 => Some(Self::U32),
            0xFF => Some(Self::Abort),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::AllReduceSum => "all_reduce_sum",
            Self::AllGather => "all_gather",
            Self::Barrier => "barrier",
            Self::F32 => "send/recv",
            Self::U32 => "send_u32/recv_u32",
            Self::Abort => "abort",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    tag: u8,
    seq: u64,
    count: u64,
}

impl Header {
    fn to_bytes(self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.tag;
        b[1..9].copy_from_slice(&self.seq.to_le_bytes());
        b[9..17].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8; HEADER_LEN]) -> Self {
        Self { tag: b[0], seq: u64_at(b, 1), count: u64_at(b, 9) }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hello {
    version: u32,
    group: u64,
    world: u64,
    from: u64,
    to: u64,
}

impl Hello {
    fn to_bytes(self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..20].copy_from_slice(&self.group.to_le_bytes());
        b[20..28].copy_from_slice(&self.world.to_le_bytes());
        b[28..36].copy_from_slice(&self.from.to_le_bytes());
        b[36..44].copy_from_slice(&self.to.to_le_bytes());
        b
    }

    /// `None` when the bytes do not start with the magic: not one of ours.
    fn from_bytes(b: &[u8; HELLO_LEN]) -> Option<Self> {
        if b[..8] != MAGIC {
            return None;
        }
        Some(Self {
            version: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            group: u64_at(b, 12),
            world: u64_at(b, 20),
            from: u64_at(b, 28),
            to: u64_at(b, 36),
        })
    }

    /// Checks a peer's hello against ours (`me`); the rank it comes from is checked by the caller.
    fn judge(&self, me: &Hello) -> Result<(), (u8, String)> {
        if self.version != me.version {
            return Err((REJECT_VERSION, format!("wire version {}, ours {}", self.version, me.version)));
        }
        if self.group != me.group {
            return Err((REJECT_GROUP, format!("group {:#x}, ours {:#x}", self.group, me.group)));
        }
        if self.world != me.world {
            return Err((REJECT_WORLD, format!("world size {}, ours {}", self.world, me.world)));
        }
        if self.to != me.from {
            return Err((REJECT_RANK, format!("addressed to rank {}, this is rank {}", self.to, me.from)));
        }
        Ok(())
    }
}

fn u64_at<const N: usize>(b: &[u8; N], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// A 4-byte element that travels little-endian.
trait Word: Copy {
    fn to_le(self) -> [u8; 4];
    fn from_le(b: [u8; 4]) -> Self;
}

impl Word for f32 {
    fn to_le(self) -> [u8; 4] {
        self.to_le_bytes()
    }
    fn from_le(b: [u8; 4]) -> Self {
        f32::from_le_bytes(b)
    }
}

impl Word for u32 {
    fn to_le(self) -> [u8; 4] {
        self.to_le_bytes()
    }
    fn from_le(b: [u8; 4]) -> Self {
        u32::from_le_bytes(b)
    }
}

fn word_at<W: Word>(c: &[u8]) -> W {
    W::from_le([c[0], c[1], c[2], c[3]])
}

fn decode_words<W: Word>(bytes: &[u8], out: &mut [W]) {
    for (x, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *x = word_at(c);
    }
}

/// One end of the connection to a peer rank.
#[derive(Debug)]
struct Link {
    stream: TcpStream,
    /// Operations completed on this link; the peer's count is the same while both agree.
    seq: u64,
    /// A write failed, possibly mid-frame: anything written after it would be read as the rest
    /// of that frame, so no abort frame may follow.
    torn: bool,
}

/// A rank's connections to every other rank of its group (see the module comment).
pub struct TcpCollective {
    rank: usize,
    world: usize,
    op_timeout: Duration,
    /// Connection to each rank, indexed by rank; `None` at our own rank.
    links: Vec<Option<Link>>,
    /// Frame bytes being encoded or decoded, kept between calls so steady state does not
    /// allocate; grows to the largest frame seen.
    buf: Vec<u8>,
    /// The error that broke the collective (fail-stop).
    broken: Option<String>,
}

impl fmt::Debug for TcpCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl TcpCollective {
    /// Joins group `group` as rank `rank` of `addrs.len()`. `listener` is already bound (its
    /// address is `addrs[rank]` as the others see it); `addrs[p]` is where rank `p` listens.
    /// Connecting, including waiting for ranks not yet started, takes at most `timeout`;
    /// afterwards a call fails with `Timeout` when a peer makes no progress for `op_timeout`.
    pub fn connect(
        rank: usize,
        listener: TcpListener,
        addrs: &[SocketAddr],
        group: u64,
        timeout: Duration,
        op_timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let world = addrs.len();
        if rank >= world {
            return Err(CollectiveError::Setup(format!("rank {rank} out of range for {world} addresses")));
        }
        if op_timeout.is_zero() {
            return Err(CollectiveError::Setup("op_timeout must be positive".into()));
        }
        let deadline = Instant::now()
            .checked_add(timeout)
            .ok_or_else(|| CollectiveError::Setup(format!("timeout {timeout:?} too large")))?;
        let me = Hello { version: VERSION, group, world: world as u64, from: rank as u64, to: 0 };
        let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        for (peer, (slot, addr)) in links.iter_mut().zip(addrs).enumerate().take(rank) {
            let stream = dial(&me, peer, *addr, deadline, timeout)?;
            *slot = Some(Link { stream, seq: 0, torn: false });
        }
        accept_peers(&listener, &me, deadline, timeout, op_timeout, &mut links)?;
        for (peer, link) in links.iter().enumerate() {
            if let Some(link) = link {
                let s = &link.stream;
                s.set_nodelay(true)
                    .and_then(|()| s.set_read_timeout(Some(op_timeout)))
                    .and_then(|()| s.set_write_timeout(Some(op_timeout)))
                    .map_err(|e| {
                        CollectiveError::Setup(format!("rank {rank}: configuring the connection to rank {peer}: {e}"))
                    })?;
            }
        }
        Ok(Self { rank, world, op_timeout, links, buf: Vec::new(), broken: None })
    }

    /// Runs one call under the fail-stop rule (module comment).
    fn guarded<T>(&mut self, call: impl FnOnce(&mut Self) -> Result<T, CollectiveError>) -> Result<T, CollectiveError> {
        if let Some(why) = &self.broken {
            return Err(CollectiveError::Broken(why.clone()));
        }
        let result = call(self);
        if let Err(e) = &result {
            if !matches!(e, CollectiveError::InvalidArgument { .. }) {
                self.break_with(e);
            }
        }
        result
    }

    /// Tells every peer we can still write to why we stop, then closes our sending side.
    fn break_with(&mut self, err: &CollectiveError) {
        let kind = if matches!(err, CollectiveError::Mismatch { .. }) { ABORT_MISMATCH } else { ABORT_FAILED };
        let mut reason = err.to_string();
        let mut cut = reason.len().min(MAX_ABORT_BYTES - 1);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
        let abort_timeout = ABORT_WRITE_TIMEOUT.min(self.op_timeout);
        for link in self.links.iter_mut().flatten() {
            if !link.torn {
                let header = Header { tag: Tag::Abort as u8, seq: link.seq, count: 1 + reason.len() as u64 };
                let mut frame = header.to_bytes().to_vec();
                frame.push(kind);
                frame.extend_from_slice(reason.as_bytes());
                // Best effort: the peer may be gone already.
                let _ = link.stream.set_write_timeout(Some(abort_timeout));
                let _ = link.stream.write_all(&frame);
            }
            let _ = link.stream.shutdown(Shutdown::Write);
        }
        self.broken = Some(err.to_string());
    }

    fn link(&mut self, peer: usize, op: &'static str) -> Result<&mut Link, CollectiveError> {
        self.links.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| CollectiveError::InvalidArgument {
            op,
            detail: format!("no connection to rank {peer} (world {})", self.world),
        })
    }

    /// A point-to-point peer must be another rank of the group.
    fn check_peer(&self, op: &'static str, peer: usize) -> Result<(), CollectiveError> {
        if peer >= self.world || peer == self.rank {
            return Err(CollectiveError::InvalidArgument {
                op,
                detail: format!("peer rank {peer} is not another rank of {} (this is rank {})", self.world, self.rank),
            });
        }
        Ok(())
    }

    /// Encodes a frame of `data` into `buf` (seq left for `write_encoded`); returns its length.
    fn encode<W: Word>(&mut self, tag: Tag, data: &[W]) -> usize {
        let len = HEADER_LEN + 4 * data.len();
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        let header = Header { tag: tag as u8, seq: 0, count: data.len() as u64 };
        self.buf[..HEADER_LEN].copy_from_slice(&header.to_bytes());
        for (c, x) in self.buf[HEADER_LEN..len].chunks_exact_mut(4).zip(data) {
            c.copy_from_slice(&x.to_le());
        }
        len
    }

    /// Writes the first `len` bytes of `buf` to `peer`, stamped with that link's seq.
    fn write_encoded(&mut self, peer: usize, op: &'static str, len: usize) -> Result<(), CollectiveError> {
        let timeout = self.op_timeout;
        let link = self
            .links
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| CollectiveError::InvalidArgument { op, detail: format!("no connection to rank {peer}") })?;
        let frame = &mut self.buf[..len];
        frame[1..9].copy_from_slice(&link.seq.to_le_bytes());
        if let Err(e) = link.stream.write_all(frame) {
            link.torn = true;
            return Err(io_error(peer, op, e, timeout));
        }
        Ok(())
    }

    /// Reads the next header from `peer` and checks it is `tag` at this link's seq with
    /// `count` elements (any count up to the cap when `None`); returns the count.
    fn read_header(
        &mut self,
        peer: usize,
        op: &'static str,
        tag: Tag,
        count: Option<usize>,
    ) -> Result<usize, CollectiveError> {
        let timeout = self.op_timeout;
        let link = self.link(peer, op)?;
        let mut raw = [0u8; HEADER_LEN];
        link.stream.read_exact(&mut raw).map_err(|e| io_error(peer, op, e, timeout))?;
        let got = Header::from_bytes(&raw);
        let Some(got_tag) = Tag::from_byte(got.tag) else {
            return Err(CollectiveError::Protocol { peer, op, detail: format!("unknown frame tag {:#04x}", got.tag) });
        };
        if got_tag == Tag::Abort {
            return Err(read_abort(&mut link.stream, peer, op, got.count));
        }
        let count_ok = count.is_none_or(|c| got.count == c as u64);
        if got_tag != tag || got.seq != link.seq || !count_ok {
            let ours = match count {
                Some(c) => format!(" with {c} elements"),
                None => String::new(),
            };
            return Err(CollectiveError::Mismatch {
                peer,
                op,
                detail: format!(
                    "rank {peer} sent {} #{} with {} elements; this rank is in {} #{}{ours}",
                    got_tag.name(),
                    got.seq,
                    got.count,
                    tag.name(),
                    link.seq
                ),
            });
        }
        if got.count > (MAX_FRAME_BYTES / 4) as u64 {
            return Err(CollectiveError::Protocol {
                peer,
                op,
                detail: format!("frame of {} elements exceeds the {MAX_FRAME_BYTES}-byte cap", got.count),
            });
        }
        Ok(got.count as usize)
    }

    /// Reads a payload of `count` elements (already checked against the cap) from `peer`.
    fn read_payload(&mut self, peer: usize, op: &'static str, count: usize) -> Result<&[u8], CollectiveError> {
        let timeout = self.op_timeout;
        let len = 4 * count;
        let link = self
            .links
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| CollectiveError::InvalidArgument { op, detail: format!("no connection to rank {peer}") })?;
        let mut done = 0;
        while done < len {
            let end = len.min(done + READ_STEP);
            if self.buf.len() < end {
                self.buf.resize(end, 0);
            }
            link.stream.read_exact(&mut self.buf[done..end]).map_err(|e| io_error(peer, op, e, timeout))?;
            done = end;
        }
        Ok(&self.buf[..len])
    }

    /// Marks one more operation done on the link to `peer`.
    fn bump(&mut self, peer: usize) {
        if let Some(Some(link)) = self.links.get_mut(peer) {
            link.seq += 1;
        }
    }

    /// Marks one more collective done on every link of the star (module comment).
    fn bump_star(&mut self) {
        if self.rank == 0 {
            for link in self.links.iter_mut().flatten() {
                link.seq += 1;
            }
        } else {
            self.bump(0);
        }
    }

    fn send_words<W: Word>(
        &mut self,
        op: &'static str,
        tag: Tag,
        to: usize,
        data: &[W],
    ) -> Result<(), CollectiveError> {
        self.check_peer(op, to)?;
        check_cap(op, data.len())?;
        self.guarded(|c| {
            let len = c.encode(tag, data);
            c.write_encoded(to, op, len)?;
            c.bump(to);
            Ok(())
        })
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        const OP: &str = "all_reduce_sum";
        check_cap(OP, data.len())?;
        if self.world == 1 {
            return Ok(());
        }
        let n = data.len();
        self.guarded(|c| {
            if c.rank == 0 {
                // Peers in rank order: data becomes ((x0 + x1) + x2) ...
                for peer in 1..c.world {
                    c.read_header(peer, OP, Tag::AllReduceSum, Some(n))?;
                    let bytes = c.read_payload(peer, OP, n)?;
                    for (x, b) in data.iter_mut().zip(bytes.chunks_exact(4)) {
                        *x += word_at::<f32>(b);
                    }
                }
                let len = c.encode(Tag::AllReduceSum, data);
                for peer in 1..c.world {
                    c.write_encoded(peer, OP, len)?;
                }
            } else {
                let len = c.encode(Tag::AllReduceSum, data);
                c.write_encoded(0, OP, len)?;
                c.read_header(0, OP, Tag::AllReduceSum, Some(n))?;
                let bytes = c.read_payload(0, OP, n)?;
                decode_words(bytes, data);
            }
            c.bump_star();
            Ok(())
        })
    }

    fn all_gather(&mut self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        const OP: &str = "all_gather";
        let n = local.len();
        let total = n.checked_mul(self.world).filter(|&t| t == out.len());
        let Some(total) = total else {
            return Err(CollectiveError::InvalidArgument {
                op: OP,
                detail: format!("out has {} elements, expected {n} x {} ranks", out.len(), self.world),
            });
        };
        check_cap(OP, total)?;
        if self.world == 1 {
            out.copy_from_slice(local);
            return Ok(());
        }
        self.guarded(|c| {
            if c.rank == 0 {
                out[..n].copy_from_slice(local);
                for peer in 1..c.world {
                    c.read_header(peer, OP, Tag::AllGather, Some(n))?;
                    let bytes = c.read_payload(peer, OP, n)?;
                    decode_words(bytes, &mut out[peer * n..(peer + 1) * n]);
                }
                let len = c.encode(Tag::AllGather, out);
                for peer in 1..c.world {
                    c.write_encoded(peer, OP, len)?;
                }
            } else {
                let len = c.encode(Tag::AllGather, local);
                c.write_encoded(0, OP, len)?;
                c.read_header(0, OP, Tag::AllGather, Some(total))?;
                let bytes = c.read_payload(0, OP, total)?;
                decode_words(bytes, out);
            }
            c.bump_star();
            Ok(())
        })
    }

    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), CollectiveError> {
        self.send_words("send", Tag::F32, to, data)
    }

    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), CollectiveError> {
        const OP: &str = "recv";
        self.check_peer(OP, from)?;
        check_cap(OP, data.len())?;
        self.guarded(|c| {
            c.read_header(from, OP, Tag::F32, Some(data.len()))?;
            let bytes = c.read_payload(from, OP, data.len())?;
            decode_words(bytes, data);
            c.bump(from);
            Ok(())
        })
    }

    fn send_u32(&mut self, to: usize, data: &[u32]) -> Result<(), CollectiveError> {
        self.send_words("send_u32", Tag::U32, to, data)
    }

    fn recv_u32(&mut self, from: usize, data: &mut Vec<u32>) -> Result<(), CollectiveError> {
        const OP: &str = "recv_u32";
        self.check_peer(OP, from)?;
        self.guarded(|c| {
            let count = c.read_header(from, OP, Tag::U32, None)?;
            let bytes = c.read_payload(from, OP, count)?;
            data.clear();
            data.extend(bytes.chunks_exact(4).map(word_at::<u32>));
            c.bump(from);
            Ok(())
        })
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        const OP: &str = "barrier";
        if self.world == 1 {
            return Ok(());
        }
        self.guarded(|c| {
            let len = c.encode::<f32>(Tag::Barrier, &[]);
            if c.rank == 0 {
                for peer in 1..c.world {
                    c.read_header(peer, OP, Tag::Barrier, Some(0))?;
                }
                for peer in 1..c.world {
                    c.write_encoded(peer, OP, len)?;
                }
            } else {
                c.write_encoded(0, OP, len)?;
                c.read_header(0, OP, Tag::Barrier, Some(0))?;
            }
            c.bump_star();
            Ok(())
        })
    }
}

/// A call may not move more than `MAX_FRAME_BYTES` in one frame.
fn check_cap(op: &'static str, count: usize) -> Result<(), CollectiveError> {
    if count > MAX_FRAME_BYTES / 4 {
        return Err(CollectiveError::InvalidArgument {
            op,
            detail: format!("{count} elements exceed the {MAX_FRAME_BYTES}-byte frame cap"),
        });
    }
    Ok(())
}

fn io_error(peer: usize, op: &'static str, e: io::Error, timeout: Duration) -> CollectiveError {
    use io::ErrorKind as K;
    match e.kind() {
        K::WouldBlock | K::TimedOut => CollectiveError::Timeout { peer, op, after: timeout },
        K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => {
            CollectiveError::PeerClosed { peer, op }
        }
        _ => CollectiveError::Io { peer, op, source: e },
    }
}

/// Turns the abort frame `peer` sent (payload `len` bytes: kind + reason) into our error.
fn read_abort(stream: &mut TcpStream, peer: usize, op: &'static str, len: u64) -> CollectiveError {
    if len == 0 || len > MAX_ABORT_BYTES as u64 {
        return CollectiveError::Protocol { peer, op, detail: format!("abort message of {len} bytes") };
    }
    let mut payload = vec![0u8; len as usize];
    if let Err(e) = stream.read_exact(&mut payload) {
        return CollectiveError::PeerAborted { peer, op, reason: format!("(reason lost: {e})") };
    }
    let (kind, text) = payload.split_first().unwrap_or((&ABORT_FAILED, &[]));
    let text = String::from_utf8_lossy(text).into_owned();
    if *kind == ABORT_MISMATCH {
        CollectiveError::Mismatch { peer, op, detail: format!("reported by rank {peer}: {text}") }
    } else {
        CollectiveError::PeerAborted { peer, op, reason: text }
    }
}

/// Time left before `deadline`, `None` once it has passed.
fn remaining(deadline: Instant) -> Option<Duration> {
    deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())
}

/// Connects to rank `peer` at `addr` (retrying until `deadline` while it is not listening yet)
/// and exchanges hellos.
fn dial(
    me: &Hello,
    peer: usize,
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, CollectiveError> {
    let fail =
        |what: String| CollectiveError::Setup(format!("rank {} connecting to rank {peer} at {addr}: {what}", me.from));
    let mut last = String::from("no attempt");
    let mut stream = loop {
        let left = remaining(deadline).ok_or_else(|| fail(format!("timed out after {timeout:?} ({last})")))?;
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => break s,
            Err(e) => {
                last = e.to_string();
                thread::sleep(CONNECT_RETRY.min(left));
            }
        }
    };
    let left = remaining(deadline).ok_or_else(|| fail(format!("timed out after {timeout:?}")))?;
    stream
        .set_read_timeout(Some(left))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .map_err(|e| fail(e.to_string()))?;
    let hello = Hello { to: peer as u64, ..*me };
    stream.write_all(&hello.to_bytes()).map_err(|e| fail(format!("sending hello: {e}")))?;
    let mut reply = [0u8; HELLO_LEN];
    let mut verdict = [0u8; 1];
    stream
        .read_exact(&mut reply)
        .and_then(|()| stream.read_exact(&mut verdict))
        .map_err(|e| fail(format!("no hello back: {e}")))?;
    let theirs = Hello::from_bytes(&reply).ok_or_else(|| fail("the listener is not a Tessera collective".into()))?;
    theirs.judge(me).map_err(|(_, why)| fail(why))?;
    if theirs.from != peer as u64 {
        return Err(fail(format!("the listener is rank {}", theirs.from)));
    }
    match verdict[0] {
        ACCEPTED => Ok(stream),
        REJECT_DUPLICATE => Err(fail(format!("refused: rank {} is already connected", me.from))),
        v => Err(fail(format!("refused (verdict {v})"))),
    }
}

/// Accepts ranks above ours until all are connected or `deadline` passes. Connections that fail
/// the handshake are dropped and listed in the timeout error.
fn accept_peers(
    listener: &TcpListener,
    me: &Hello,
    deadline: Instant,
    timeout: Duration,
    op_timeout: Duration,
    links: &mut [Option<Link>],
) -> Result<(), CollectiveError> {
    let rank = me.from as usize;
    let mut waiting = links.len() - rank - 1;
    if waiting == 0 {
        return Ok(());
    }
    let setup = |what: String| CollectiveError::Setup(format!("rank {rank}: {what}"));
    listener.set_nonblocking(true).map_err(|e| setup(format!("listener: {e}")))?;
    let mut rejected: Vec<String> = Vec::new();
    while waiting > 0 {
        let Some(left) = remaining(deadline) else {
            let missing: Vec<usize> =
                (rank + 1..links.len()).filter(|&p| links.get(p).is_some_and(Option::is_none)).collect();
            let rejected =
                if rejected.is_empty() { String::new() } else { format!("; rejected: {}", rejected.join("; ")) };
            return Err(setup(format!(
                "timed out after {timeout:?} waiting for ranks {missing:?} to connect{rejected}"
            )));
        };
        match listener.accept() {
            Ok((stream, from)) => match greet(stream, me, left.min(op_timeout), links) {
                Ok(()) => waiting -= 1,
                Err(why) => {
                    if rejected.len() < 8 {
                        rejected.push(format!("{from}: {why}"));
                    }
                }
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(ACCEPT_POLL.min(left));
            }
            // Transient (a connection reset before accept, out of descriptors): keep waiting.
            Err(_) => thread::sleep(ACCEPT_POLL.min(left)),
        }
    }
    Ok(())
}

/// The acceptor's side of the handshake on one connection; on success the link is stored.
fn greet(mut stream: TcpStream, me: &Hello, wait: Duration, links: &mut [Option<Link>]) -> Result<(), String> {
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(wait)))
        .and_then(|()| stream.set_write_timeout(Some(wait)))
        .map_err(|e| e.to_string())?;
    let mut raw = [0u8; HELLO_LEN];
    stream.read_exact(&mut raw).map_err(|e| format!("no hello: {e}"))?;
    let theirs = Hello::from_bytes(&raw).ok_or("not a Tessera collective (bad magic)")?;
    let verdict = theirs.judge(me).and_then(|()| {
        let from = theirs.from;
        if from <= me.from || from >= me.world {
            return Err((REJECT_RANK, format!("rank {from} does not dial rank {}", me.from)));
        }
        match links.get(from as usize) {
            Some(None) => Ok(from as usize),
            _ => Err((REJECT_DUPLICATE, format!("rank {from} connected twice"))),
        }
    });
    let mut reply = [0u8; HELLO_LEN + 1];
    let ours = Hello { to: theirs.from, ..*me };
    reply[..HELLO_LEN].copy_from_slice(&ours.to_bytes());
    reply[HELLO_LEN] = match &verdict {
        Ok(_) => ACCEPTED,
        Err((code, _)) => *code,
    };
    stream.write_all(&reply).map_err(|e| format!("sending hello: {e}"))?;
    let peer = verdict.map_err(|(_, why)| why)?;
    if let Some(slot) = links.get_mut(peer) {
        *slot = Some(Link { stream, seq: 0, torn: false });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_hello_round_trip() {
        let h = Header { tag: Tag::U32 as u8, seq: 0x0123_4567_89ab_cdef, count: 0xfedc_ba98_7654_3210 };
        assert_eq!(Header::from_bytes(&h.to_bytes()), h);
        let hello = Hello { version: VERSION, group: 0xdead_beef_0bad_f00d, world: 3, from: 2, to: 1 };
        let bytes = hello.to_bytes();
        assert_eq!(Hello::from_bytes(&bytes), Some(hello));
        let mut stray = bytes;
        stray[0] ^= 1;
        assert_eq!(Hello::from_bytes(&stray), None);
    }

    #[test]
    fn collective_hello_judge_names_what_differs() {
        let me = Hello { version: VERSION, group: 7, world: 4, from: 1, to: 0 };
        let ok = Hello { from: 3, to: 1, ..me };
        assert!(ok.judge(&me).is_ok());
        let cases = [
            (Hello { group: 8, ..ok }, REJECT_GROUP, "group"),
            (Hello { world: 2, ..ok }, REJECT_WORLD, "world"),
            (Hello { version: 9, ..ok }, REJECT_VERSION, "version"),
            (Hello { to: 2, ..ok }, REJECT_RANK, "addressed"),
        ];
        for (h, code, word) in cases {
            let (got, why) = h.judge(&me).err().unwrap_or((0, String::new()));
            assert_eq!(got, code, "{h:?}");
            assert!(why.contains(word), "{why}");
        }
    }

    #[test]
    fn collective_tags_round_trip_and_unknown_is_none() {
        for t in [Tag::AllReduceSum, Tag::AllGather, Tag::Barrier, Tag::F32, Tag::U32, Tag::Abort] {
            assert_eq!(Tag::from_byte(t as u8), Some(t));
        }
        assert_eq!(Tag::from_byte(0), None);
        assert_eq!(Tag::from_byte(6), None);
    }
}
