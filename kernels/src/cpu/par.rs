//! How a CPU op's independent tasks are spread over rayon's pool.
//!
//! Three ways, chosen once per process by `TESSERA_CPU_PAR`:
//! - `steal`: a parallel iterator over the tasks. Rayon splits the range in halves, one
//!   join at a time, and idle threads steal the halves: each level of the split costs a
//!   steal, so on many threads a small op waits for a cascade of them before every thread
//!   has work.
//! - `broadcast`: one job per pool thread, injected at once
//!   (`rayon::broadcast`), each thread claiming tasks from a shared counter until none are
//!   left. No split tree; a thread that gets there late finds fewer tasks, so the balance
//!   is still dynamic. The calling thread, when it is one of the pool's, runs its own job.
//! - `team` (the default): `par_team.rs`'s own threads, spinning between ops instead of
//!   sleeping, each with its own share of the tasks (16-core Xeon, `par_bench`: an op of
//!   16 empty tasks 4.2 µs against the broadcast's 7.4; the first team, which claimed
//!   from one shared counter, already gave SmolLM2 decode +14%, prefill +6% over the
//!   broadcast, which was +37% / +8% over rayon's split; bench/RESULTS.md). It
//!   falls back to the broadcast when busy or in another pool.
//!
//! Every way, every task runs exactly once, on some thread, so results do not depend on
//! the choice (each task writes its own outputs). A call from inside another call's task
//! runs its tasks in place (the outer call already spread the work).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use rayon::prelude::*;

/// The two dispatch methods (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParMode {
    Steal,
    Broadcast,
    /// `par_team.rs`'s spinning threads (falls back to a broadcast when the team is busy
    /// with another caller or sized for another pool).
    Team,
}

/// The process's dispatch method: `TESSERA_CPU_PAR` (`steal`, `broadcast` or `team`), else
/// the default (`team`). An unknown value keeps the default (this is a tuning switch, not an input).
pub fn mode() -> ParMode {
    static MODE: OnceLock<ParMode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("TESSERA_CPU_PAR").as_deref() {
        Ok("steal") => ParMode::Steal,
        Ok("broadcast") => ParMode::Broadcast,
        _ => ParMode::Team,
    })
}

/// Runs `task(i)` for every `i` in `0..tasks` on the current rayon pool (see the module
/// docs); returns when all have run. A single task runs on the calling thread.
pub fn for_each_task(tasks: usize, task: impl Fn(usize) + Sync) {
    for_each_task_with(mode(), tasks, task)
}

/// [`for_each_task`] with an explicit method (tests and benchmarks).
pub fn for_each_task_with(mode: ParMode, tasks: usize, task: impl Fn(usize) + Sync) {
    if tasks <= 1 || rayon::current_num_threads() <= 1 || IN_TASK.get() {
        (0..tasks).for_each(task);
        return;
    }
    let run = |i: usize| run_task(&task, i);
    match mode {
        ParMode::Steal => (0..tasks).into_par_iter().for_each(run),
        ParMode::Team if team_fits() && super::par_team::team().try_run(tasks, &task) => {}
        ParMode::Team | ParMode::Broadcast => {
            let next = AtomicUsize::new(0);
            rayon::broadcast(|_| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= tasks {
                    break;
                }
                run(i);
            });
        }
    }
}

/// Splits `data` into chunks of `chunk` values (the last may be shorter) and runs
/// `f(i, chunk_i)` for each as a task of [`for_each_task`]. `chunk` 0 is taken as 1.
pub fn for_each_chunk_mut<T: Send>(data: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let (len, chunk) = (data.len(), chunk.max(1));
    let base = SharedMut::new(data);
    for_each_task(len.div_ceil(chunk), |i| {
        let start = i * chunk;
        // SAFETY: chunk `i` is `[start, min(start + chunk, len))`, disjoint from every
        // other task's; `start < len` for every task index.
        f(i, unsafe { base.slice(start, (start + chunk).min(len)) });
    });
}

/// A mutable buffer shared by tasks that each take their own disjoint range of it (split
/// by index arithmetic rather than by `&mut` chunks, which [`for_each_task`]'s shared
/// closure cannot hand out). Holds the buffer's borrow for its lifetime.
pub(crate) struct SharedMut<'a, T> {
    base: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: tasks get `&mut` to disjoint ranges only (see `slice`), as a split into `&mut`
// chunks sent to other threads would give them; `T: Send` is what that needs.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub(crate) fn new(data: &'a mut [T]) -> Self {
        SharedMut { base: data.as_mut_ptr(), len: data.len(), _borrow: std::marker::PhantomData }
    }

    /// Elements `start..end` (panics outside the buffer).
    ///
    /// # Safety
    /// No other live slice from this buffer may overlap `start..end`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, end: usize) -> &mut [T] {
        assert!(start <= end && end <= self.len, "range {start}..{end} of {}", self.len);
        // SAFETY: in bounds (asserted), not aliased (the caller's contract), and the
        // buffer is borrowed for 'a.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(start), end - start) }
    }
}

/// [`for_each_chunk_mut`] over rows of `row` values, a few rows per task (at least
/// [`ROW_TASK_VALUES`] values, so that many short rows do not become as many tasks):
/// `f(r, row_r)` for each row `r`.
pub fn for_each_row_mut<T: Send>(data: &mut [T], row: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let row = row.max(1);
    let per = rows_per_task(row);
    for_each_chunk_mut(data, row * per, |i, rows| {
        for (j, r) in rows.chunks_mut(row).enumerate() {
            f(i * per + j, r);
        }
    });
}

/// Smallest task of [`for_each_row_mut`], in values.
const ROW_TASK_VALUES: usize = 1024;

/// Rows of `row` values per task in [`for_each_row_mut`] (for callers that group rows
/// themselves, e.g. to share a scratch buffer across a task's rows).
pub fn rows_per_task(row: usize) -> usize {
    (ROW_TASK_VALUES / row.max(1)).max(1)
}

/// Runs task `i` of a parallel call, marked as such for nested calls.
pub(crate) fn run_task(task: &(dyn Fn(usize) + Sync), i: usize) {
    let _flag = InTask::enter();
    task(i);
}

/// Whether the team matches the caller's pool: the same number of threads (the team is
/// sized once for the global pool; a caller in another pool broadcasts instead).
fn team_fits() -> bool {
    super::par_team::team().workers() + 1 == rayon::current_num_threads()
}

/// Whether this thread is running a task of a parallel [`for_each_task`], where a nested
/// call runs in place (ops that choose their split by the thread count should then plan
/// for one thread).
pub fn in_task() -> bool {
    IN_TASK.get()
}

/// Sets [`IN_TASK`] for the life of a task and puts back the previous value on drop, also
/// when the task unwinds (rayon catches a task's panic and keeps the thread, which must
/// not go on running every later op in place).
struct InTask(bool);

impl InTask {
    fn enter() -> Self {
        InTask(IN_TASK.replace(true))
    }
}

impl Drop for InTask {
    fn drop(&mut self) {
        IN_TASK.set(self.0);
    }
}

thread_local! {
    /// Set while this thread runs a task of a parallel [`for_each_task`]: a call made from
    /// inside one runs its tasks in place, so nested ops (each sequence's attention inside
    /// the loop over a batch's sequences) split the work once, at the outer level, instead
    /// of broadcasting to every thread from every task.
    static IN_TASK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Every task runs exactly once under both methods, from outside and from inside the
    /// pool, for task counts below, at and above the thread count.
    #[test]
    fn every_task_runs_once() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().expect("pool");
        for mode in [ParMode::Steal, ParMode::Broadcast, ParMode::Team] {
            for tasks in [0usize, 1, 3, 4, 5, 64, 1000] {
                let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
                let run = || {
                    for_each_task_with(mode, tasks, |i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    })
                };
                pool.install(run);
                pool.install(|| rayon::scope(|_| run()));
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 2), "{mode:?} {tasks} tasks");
            }
        }
    }

    /// Chunks cover the slice exactly once, the last one short.
    #[test]
    fn chunks_cover_the_slice() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("pool");
        let mut v = vec![0u32; 1000];
        pool.install(|| {
            for_each_chunk_mut(&mut v, 64, |i, c| {
                assert!(c.len() == 64 || (i == 15 && c.len() == 40), "chunk {i}: {}", c.len());
                c.iter_mut().for_each(|x| *x += 1 + i as u32);
            })
        });
        assert!(v.iter().enumerate().all(|(j, &x)| x == 1 + (j / 64) as u32));
    }

    /// Rows are grouped into tasks but each is visited once, with its own index.
    #[test]
    fn rows_are_visited_once_with_their_index() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("pool");
        for (rows, row) in [(1usize, 7usize), (100, 576), (1000, 3), (5, 10_000)] {
            let mut v = vec![0usize; rows * row];
            pool.install(|| for_each_row_mut(&mut v, row, |r, x| x.iter_mut().for_each(|e| *e += r + 1)));
            assert!(v.iter().enumerate().all(|(j, &e)| e == j / row + 1), "{rows} x {row}");
        }
    }

    /// A task that panics leaves its thread able to run later calls in parallel again.
    #[test]
    fn a_panicking_task_does_not_leave_its_thread_in_place() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        for mode in [ParMode::Steal, ParMode::Broadcast] {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| for_each_task_with(mode, 4, |i| assert!(i != 1, "task 1 fails")))
            }));
            assert!(caught.is_err(), "{mode:?}: the panic reaches the caller");
            let flags: Vec<bool> = pool.broadcast(|_| in_task());
            assert!(flags.iter().all(|f| !f), "{mode:?}: {flags:?}");
        }
    }

    /// A call nested in another's task runs in place, on the task's own thread, and every
    /// inner task still runs once.
    #[test]
    fn nested_calls_run_in_place() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().expect("pool");
        let hits: Vec<AtomicU32> = (0..8 * 16).map(|_| AtomicU32::new(0)).collect();
        let moved = AtomicU32::new(0);
        pool.install(|| {
            for_each_task_with(ParMode::Broadcast, 8, |i| {
                let me = std::thread::current().id();
                for_each_task_with(ParMode::Broadcast, 16, |j| {
                    if std::thread::current().id() != me {
                        moved.fetch_add(1, Ordering::Relaxed);
                    }
                    hits[i * 16 + j].fetch_add(1, Ordering::Relaxed);
                });
            })
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        assert_eq!(moved.load(Ordering::Relaxed), 0);
    }
}
