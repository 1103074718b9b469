//! `TcpCollective` end to end: every rank is a thread of this process talking over 127.0.0.1
//! (port-0 listeners whose addresses are shared before connecting). Results are checked
//! against references computed here (rank-order sums, concatenations); failures (mismatched
//! calls, dropped or silent ranks, strangers, other groups, hostile frames) must end in the
//! documented error within the timeout, never a hang or a panic.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_worker::collective::{Collective, CollectiveError, TcpCollective};

/// Setup and per-op timeouts for tests that must succeed: far above any real delay.
const LONG: Duration = Duration::from_secs(20);
/// Timeout for tests that expect one.
const SHORT: Duration = Duration::from_millis(400);
/// Slack for a loaded 2-core machine when checking "failed within the timeout".
const MARGIN: Duration = Duration::from_secs(3);
const LENS: [usize; 4] = [0, 1, 1000, 1 << 20];

fn bind(world: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let listeners: Vec<TcpListener> = (0..world).map(|_| TcpListener::bind("127.0.0.1:0").expect("bind")).collect();
    let addrs = listeners.iter().map(|l| l.local_addr().expect("local_addr")).collect();
    (listeners, addrs)
}

/// Connects `world` ranks of group `group`, each from its own thread; returns them by rank.
fn connect_all(world: usize, group: u64, op_timeout: Duration) -> Vec<TcpCollective> {
    let (listeners, addrs) = bind(world);
    thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let addrs = &addrs;
                s.spawn(move || TcpCollective::connect(rank, l, addrs, group, LONG, op_timeout))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread").expect("connect")).collect()
    })
}

/// Runs `body(rank, collective)` on one thread per rank of a fresh group. The collectives are
/// dropped only after every rank finished, so no rank sees a peer vanish early.
fn run_group<T: Send>(
    world: usize,
    op_timeout: Duration,
    body: impl Fn(usize, &mut TcpCollective) -> T + Sync,
) -> Vec<T> {
    let ranks = connect_all(world, 0x7e55, op_timeout);
    let done: Vec<(T, TcpCollective)> = thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(rank, mut c)| {
                let body = &body;
                s.spawn(move || (body(rank, &mut c), c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    done.into_iter().map(|(t, _)| t).collect()
}

/// Non-zero values of both signs over six decades, so summation order shows in the bits.
fn rand_f32(seed: u64, n: usize) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u = r.next_u32();
            let mag = 10f32.powf((u >> 8) as f32 / (1u32 << 24) as f32 * 6.0 - 3.0);
            if u & 1 == 0 {
                mag
            } else {
                -mag
            }
        })
        .collect()
}

fn seed(world: usize, rank: usize, n: usize) -> u64 {
    ((world as u64) << 48) ^ ((rank as u64) << 32) ^ n as u64
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i} is {} but should be {}", got[i], want[i]);
    }
}

fn is_mismatch(r: &Result<(), CollectiveError>) -> bool {
    matches!(r, Err(CollectiveError::Mismatch { .. }))
}

#[test]
fn all_reduce_sum_is_the_rank_order_sum_bit_for_bit_on_every_rank() {
    for world in 1..=4 {
        let outs = run_group(world, LONG, |rank, c| {
            assert_eq!((c.rank(), c.world()), (rank, world));
            LENS.iter()
                .map(|&n| {
                    let mut x = rand_f32(seed(world, rank, n), n);
                    c.all_reduce_sum(&mut x).expect("all_reduce_sum");
                    x
                })
                .collect::<Vec<_>>()
        });
        for (i, &n) in LENS.iter().enumerate() {
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| rand_f32(seed(world, r, n), n)).collect();
            let mut want = inputs[0].clone();
            for x in &inputs[1..] {
                for (w, v) in want.iter_mut().zip(x) {
                    *w += v;
                }
            }
            for (rank, out) in outs.iter().enumerate() {
                assert_same_bits(&out[i], &want, &format!("world {world} rank {rank} n {n}"));
            }
            if world >= 3 && n >= 1000 {
                // The reference is order-sensitive on this data, so the check above has teeth.
                let mut reversed = inputs[world - 1].clone();
                for x in inputs[..world - 1].iter().rev() {
                    for (w, v) in reversed.iter_mut().zip(x) {
                        *w += v;
                    }
                }
                assert!(reversed.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()));
            }
        }
    }
}

#[test]
fn all_gather_concatenates_in_rank_order_on_every_rank() {
    for world in 1..=4 {
        let outs = run_group(world, LONG, |rank, c| {
            LENS.iter()
                .map(|&n| {
                    let local = rand_f32(seed(world, rank, n) ^ 0x6a7e, n);
                    let mut out = vec![f32::NAN; n * world];
                    c.all_gather(&local, &mut out).expect("all_gather");
                    out
                })
                .collect::<Vec<_>>()
        });
        for (i, &n) in LENS.iter().enumerate() {
            let want: Vec<f32> = (0..world).flat_map(|r| rand_f32(seed(world, r, n) ^ 0x6a7e, n)).collect();
            for (rank, out) in outs.iter().enumerate() {
                assert_same_bits(&out[i], &want, &format!("world {world} rank {rank} n {n}"));
            }
        }
    }
}

#[test]
fn pipeline_send_recv_passes_tokens_and_hidden_states_along_stages() {
    const HIDDEN: usize = 64;
    let token_counts = [3usize, 0, 1, 257];
    let tokens = |step: usize| -> Vec<u32> {
        let mut r = ChaCha8Rng::seed_from_u64(100 + step as u64);
        (0..token_counts[step]).map(|_| r.next_u32() % 49152).collect()
    };
    let hidden = |step: usize| rand_f32(200 + step as u64, token_counts[step] * HIDDEN);
    let outs = run_group(3, LONG, |rank, c| {
        let mut seen = Vec::new();
        for step in 0..token_counts.len() {
            match rank {
                0 => {
                    c.send_u32(1, &tokens(step)).expect("send_u32");
                    c.send(1, &hidden(step)).expect("send");
                    // The last stage returns sampled ids to the first, closing the loop.
                    let mut sampled = vec![7, 7, 7];
                    c.recv_u32(2, &mut sampled).expect("recv_u32 from 2");
                    seen.push((sampled, Vec::new()));
                }
                _ => {
                    let mut ids = vec![u32::MAX; 5]; // stale contents must be replaced
                    c.recv_u32(rank - 1, &mut ids).expect("recv_u32");
                    let mut h = vec![f32::NAN; ids.len() * HIDDEN];
                    c.recv(rank - 1, &mut h).expect("recv");
                    if rank == 1 {
                        // Stage 1 "computes" (exactly) and passes on.
                        let next: Vec<f32> = h.iter().map(|x| x * 2.0).collect();
                        c.send_u32(2, &ids).expect("send_u32");
                        c.send(2, &next).expect("send");
                    } else {
                        let sampled: Vec<u32> = ids.iter().map(|t| t ^ 1).collect();
                        c.send_u32(0, &sampled).expect("send_u32 to 0");
                    }
                    seen.push((ids, h));
                }
            }
        }
        seen
    });
    assert!(outs.iter().all(|o| o.len() == token_counts.len()));
    let stages = outs[0].iter().zip(&outs[1]).zip(&outs[2]);
    for (step, ((at0, at1), at2)) in stages.enumerate() {
        let doubled: Vec<f32> = hidden(step).iter().map(|x| x * 2.0).collect();
        assert_eq!(at1.0, tokens(step), "stage 1 tokens, step {step}");
        assert_same_bits(&at1.1, &hidden(step), "stage 1 hidden");
        assert_eq!(at2.0, tokens(step), "stage 2 tokens, step {step}");
        assert_same_bits(&at2.1, &doubled, "stage 2 hidden");
        let sampled: Vec<u32> = tokens(step).iter().map(|t| t ^ 1).collect();
        assert_eq!(at0.0, sampled, "sampled ids back at stage 0, step {step}");
    }
}

#[test]
fn barrier_returns_only_after_every_rank_entered() {
    let late_rank_entered = AtomicBool::new(false);
    let outs = run_group(3, LONG, |rank, c| {
        let mut ok = true;
        for round in 0..3 {
            if rank == 2 && round == 1 {
                thread::sleep(Duration::from_millis(200));
                late_rank_entered.store(true, Ordering::SeqCst);
            }
            c.barrier().expect("barrier");
            if round >= 1 {
                ok &= late_rank_entered.load(Ordering::SeqCst);
            }
        }
        ok
    });
    assert_eq!(outs, vec![true; 3]);
    // A group of one has nobody to wait for.
    run_group(1, LONG, |_, c| c.barrier().expect("barrier of one"));
}

#[test]
fn different_lengths_give_mismatch_on_every_rank() {
    for odd_rank in [0, 1, 2] {
        let outs = run_group(3, LONG, |rank, c| {
            let n = if rank == odd_rank { 11 } else { 10 };
            let mut x = rand_f32(rank as u64, n);
            let reduce = c.all_reduce_sum(&mut x);
            let after = c.barrier();
            (reduce, matches!(after, Err(CollectiveError::Broken(_))))
        });
        for (rank, (reduce, broken_after)) in outs.iter().enumerate() {
            assert!(is_mismatch(reduce), "odd {odd_rank}, rank {rank}: {reduce:?}");
            assert!(broken_after, "rank {rank}: a failed collective must stay failed");
        }
    }
    let outs = run_group(2, LONG, |rank, c| {
        let local = rand_f32(9, 4 + rank);
        let mut out = vec![0.5; 2 * local.len()];
        c.all_gather(&local, &mut out)
    });
    assert!(outs.iter().all(is_mismatch), "{outs:?}");
}

#[test]
fn different_ops_give_mismatch_on_every_rank() {
    type Call = fn(&mut TcpCollective) -> Result<(), CollectiveError>;
    let reduce: Call = |c| c.all_reduce_sum(&mut rand_f32(1, 8));
    let gather: Call = |c| {
        let mut out = vec![1.0; 8 * c.world()];
        c.all_gather(&rand_f32(2, 8), &mut out)
    };
    let barrier: Call = |c| c.barrier();
    let cases: [&[Call]; 4] =
        [&[reduce, gather], &[gather, reduce], &[barrier, reduce, reduce], &[gather, gather, barrier]];
    for calls in cases {
        let outs = run_group(calls.len(), LONG, |rank, c| calls[rank](c));
        assert!(outs.iter().all(is_mismatch), "{outs:?}");
    }
}

#[test]
fn point_to_point_mismatch_fails_receiver_and_then_sender() {
    // Length: the receiver sees it at once, the sender on its next call.
    let outs = run_group(2, LONG, |rank, c| {
        if rank == 0 {
            let sent = c.send(1, &rand_f32(3, 5));
            (sent.is_ok(), c.barrier())
        } else {
            (true, c.recv(0, &mut [0.0; 6]))
        }
    });
    assert!(outs[0].0, "the send itself cannot know yet");
    assert!(is_mismatch(&outs[0].1) && is_mismatch(&outs[1].1), "{outs:?}");

    // Element type: u32 sent, f32 expected.
    let outs =
        run_group(2, LONG, |rank, c| if rank == 0 { c.send_u32(1, &[1, 2, 3]) } else { c.recv(0, &mut [0.0; 3]) });
    assert!(is_mismatch(&outs[1]), "{outs:?}");

    // A skipped recv: tags and lengths line up again, sequence numbers do not.
    let outs = run_group(2, LONG, |rank, c| {
        let x = rand_f32(4, 16);
        if rank == 0 {
            c.send(1, &x).expect("send");
            c.send(1, &x).expect("send");
        } else {
            c.recv(0, &mut [0.0; 16]).expect("recv");
        }
        c.all_reduce_sum(&mut rand_f32(5, 16))
    });
    assert!(outs.iter().all(is_mismatch), "{outs:?}");
}

#[test]
fn invalid_arguments_are_rejected_without_breaking_the_group() {
    let outs = run_group(2, LONG, |rank, c| {
        let bad_out = c.all_gather(&[1.0; 4], &mut [0.0; 7]);
        let to_self = c.send(rank, &[1.0]);
        let out_of_range = c.recv_u32(2, &mut Vec::new());
        let bad =
            [bad_out, to_self, out_of_range].iter().all(|r| matches!(r, Err(CollectiveError::InvalidArgument { .. })));
        let mut x = vec![rank as f32 + 0.25; 3];
        c.all_reduce_sum(&mut x).expect("still usable");
        (bad, x)
    });
    for (bad, x) in outs {
        assert!(bad);
        assert_eq!(x, vec![1.5; 3]); // 0.25 + 1.25, exact
    }
    let outs = run_group(1, LONG, |_, c| c.send(0, &[1.0]));
    assert!(matches!(outs[0], Err(CollectiveError::InvalidArgument { .. })));
}

#[test]
fn dropped_rank_makes_the_others_fail_promptly() {
    let op_timeout = Duration::from_secs(2);
    let mut ranks: Vec<Option<TcpCollective>> = connect_all(3, 1, op_timeout).into_iter().map(Some).collect();
    drop(ranks[1].take());
    let start = Instant::now();
    let outs: Vec<_> = thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .flatten()
            .map(|c| {
                s.spawn(move || {
                    let r = c.all_reduce_sum(&mut rand_f32(6, 100));
                    (r, start.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let (r0, t0) = &outs[0];
    let (r2, t2) = &outs[1];
    assert!(matches!(r0, Err(CollectiveError::PeerClosed { peer: 1, .. })), "{r0:?}");
    assert!(matches!(r2, Err(CollectiveError::PeerAborted { peer: 0, .. })), "{r2:?}");
    assert!(*t0 < op_timeout + MARGIN && *t2 < op_timeout + MARGIN, "{t0:?} {t2:?}");
}

#[test]
fn silent_rank_makes_the_others_time_out() {
    let mut ranks = connect_all(3, 2, SHORT);
    let start = Instant::now();
    let outs: Vec<_> = thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .enumerate()
            .filter(|(rank, _)| *rank != 1) // rank 1 stays connected but never calls
            .map(|(_, c)| {
                s.spawn(move || {
                    let r = c.all_reduce_sum(&mut rand_f32(7, 100));
                    let again = c.all_reduce_sum(&mut rand_f32(7, 100));
                    (r, again, start.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let (r0, again0, t0) = &outs[0];
    assert!(matches!(r0, Err(CollectiveError::Timeout { peer: 1, .. })), "{r0:?}");
    assert!(matches!(again0, Err(CollectiveError::Broken(_))), "{again0:?}");
    assert!(*t0 >= SHORT - Duration::from_millis(50), "gave up early: {t0:?}");
    // Rank 2 either hears rank 0's abort or times out waiting for it.
    let (r2, _, t2) = &outs[1];
    assert!(
        matches!(r2, Err(CollectiveError::PeerAborted { peer: 0, .. } | CollectiveError::Timeout { peer: 0, .. })),
        "{r2:?}"
    );
    assert!(*t0 < SHORT + MARGIN && *t2 < SHORT + MARGIN, "{t0:?} {t2:?}");
    drop(ranks);
}

#[test]
fn missing_rank_fails_setup_within_the_timeout() {
    // A rank never shows up, its port still bound (nobody accepts) or closed (dials are refused).
    let timeout = Duration::from_millis(500);
    for (missing, close_port) in [(2, false), (1, true)] {
        let (mut listeners, addrs) = bind(3);
        let absent = listeners.remove(missing);
        let _still_bound = if close_port {
            drop(absent);
            None
        } else {
            Some(absent)
        };
        let start = Instant::now();
        let outs: Vec<_> = thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .zip((0..3).filter(|&r| r != missing))
                .map(|(l, rank)| {
                    let addrs = &addrs;
                    s.spawn(move || {
                        let r = TcpCollective::connect(rank, l, addrs, 3, timeout, SHORT);
                        (r.err(), start.elapsed())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for (err, elapsed) in outs {
            match err {
                Some(CollectiveError::Setup(msg)) => assert!(
                    msg.contains(&format!("[{missing}]")) || msg.contains(&format!("to rank {missing}")),
                    "{msg}"
                ),
                other => panic!("expected a setup error, got {other:?}"),
            }
            assert!(elapsed < timeout + MARGIN, "{elapsed:?}");
        }
    }
}

#[test]
fn strangers_and_other_groups_are_turned_away_at_handshake() {
    let (mut listeners, addrs) = bind(2);
    let l1 = listeners.pop().expect("listener 1");
    let l0 = listeners.pop().expect("listener 0");
    thread::scope(|s| {
        let addrs = &addrs;
        let rank0 = s.spawn(move || {
            let mut c = TcpCollective::connect(0, l0, addrs, 0xA, LONG, LONG).expect("rank 0");
            let mut x = rand_f32(10, 300);
            c.all_reduce_sum(&mut x).expect("all_reduce_sum");
            x
        });
        // Garbage from a stranger, then a rank 1 of another group on the same address list.
        let mut stranger = TcpStream::connect(addrs[0]).expect("stranger");
        stranger.write_all(&[0xAB; 44]).expect("garbage");
        drop(stranger);
        let (lb, b_addr) = bind(1);
        let intruder = TcpCollective::connect(
            1,
            lb.into_iter().next().expect("listener"),
            &[addrs[0], b_addr[0]],
            0xB,
            LONG,
            LONG,
        );
        match intruder {
            Err(CollectiveError::Setup(msg)) => assert!(msg.contains("group"), "{msg}"),
            other => panic!("other group must be refused, got {other:?}"),
        }
        let mut c1 = TcpCollective::connect(1, l1, addrs, 0xA, LONG, LONG).expect("rank 1");
        let mut x1 = rand_f32(11, 300);
        c1.all_reduce_sum(&mut x1).expect("all_reduce_sum");
        let x0 = rank0.join().expect("rank 0 thread");
        let want: Vec<f32> = rand_f32(10, 300).iter().zip(rand_f32(11, 300)).map(|(a, b)| a + b).collect();
        assert_same_bits(&x0, &want, "rank 0");
        assert_same_bits(&x1, &want, "rank 1");
    });
}

/// Plays rank 1 of a world-2 group by hand, per the documented wire format, and sends
/// `frame` after the handshake; returns what rank 0's `recv_u32` made of it.
fn hostile_peer(frame: &[u8]) -> Result<Vec<u32>, CollectiveError> {
    let (mut listeners, addrs) = bind(2);
    let l0 = listeners.remove(0);
    thread::scope(|s| {
        let addrs = &addrs;
        let rank0 = s.spawn(move || {
            let mut c = TcpCollective::connect(0, l0, addrs, 5, LONG, SHORT)?;
            let mut got = vec![1, 2, 3];
            c.recv_u32(1, &mut got).map(|()| got)
        });
        let mut peer = TcpStream::connect(addrs[0]).expect("connect");
        let mut hello = b"TESSCOLL".to_vec();
        hello.extend_from_slice(&1u32.to_le_bytes()); // version
        for field in [5u64, 2, 1, 0] {
            // group, world, from rank, to rank
            hello.extend_from_slice(&field.to_le_bytes());
        }
        peer.write_all(&hello).expect("hello");
        let mut reply = [0u8; 45];
        peer.read_exact(&mut reply).expect("hello back");
        assert_eq!(&reply[..8], b"TESSCOLL");
        assert_eq!(reply[44], 0, "accepted");
        peer.write_all(frame).expect("frame");
        let result = rank0.join().expect("rank 0 must not panic");
        drop(peer);
        result
    })
}

fn frame_header(tag: u8, seq: u64, count: u64) -> Vec<u8> {
    let mut f = vec![tag];
    f.extend_from_slice(&seq.to_le_bytes());
    f.extend_from_slice(&count.to_le_bytes());
    f
}

#[test]
fn hostile_frames_give_errors_not_panics_or_huge_allocations() {
    // Announces 4 TiB of u32s.
    let r = hostile_peer(&frame_header(5, 0, 1 << 40));
    assert!(matches!(&r, Err(CollectiveError::Protocol { detail, .. }) if detail.contains("cap")), "{r:?}");
    // Unknown tag.
    let r = hostile_peer(&frame_header(0x42, 0, 1));
    assert!(matches!(r, Err(CollectiveError::Protocol { .. })), "{r:?}");
    // An abort frame with an oversized reason.
    let r = hostile_peer(&frame_header(0xFF, 0, 1 << 20));
    assert!(matches!(r, Err(CollectiveError::Protocol { .. })), "{r:?}");
    // 1000 elements announced, 10 sent, then silence: a timeout, not a wait forever.
    let mut short = frame_header(5, 0, 1000);
    short.extend_from_slice(&[1u8; 40]);
    let r = hostile_peer(&short);
    assert!(matches!(r, Err(CollectiveError::Timeout { .. })), "{r:?}");
    // A well-formed frame still works, which shows the hand-made handshake above is right.
    let mut good = frame_header(5, 0, 2);
    good.extend_from_slice(&7u32.to_le_bytes());
    good.extend_from_slice(&9u32.to_le_bytes());
    let r = hostile_peer(&good);
    assert_eq!(r.ok(), Some(vec![7, 9]));
}
