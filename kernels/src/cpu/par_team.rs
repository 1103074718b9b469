//! A team of spinning threads for the CPU step's many small parallel ops (the default
//! dispatch, see `par.rs`).
//!
//! Why: a decode step on many cores is a few hundred ops of a few microseconds each, and
//! waking rayon's threads for each (a broadcast, then a latch) costs about as much as the
//! op. The team's threads instead watch one atomic pointer: the caller publishes a job,
//! everyone (the caller too) claims tasks from its counter, the caller spins until every
//! task has finished. A thread that has seen no job for [`IDLE_PARK`] parks on a condvar,
//! so an idle worker (between requests) costs nothing.
//!
//! Protocol (every access to `job`, `epoch` and `active` is SeqCst): the caller publishes
//! `job`, then bumps `epoch`; a worker that sees a new epoch counts itself in `active`,
//! then reads `job` (whatever job it finds is one it may work on); the caller, once every
//! task is done, clears `job`, then waits for `active` to reach 0. So no worker can still
//! hold a job whose frame the caller is about to leave. A task's panic is caught on its thread and re-raised on the
//! caller's once the job has drained.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long a worker spins without a job before it parks.
const IDLE_PARK: Duration = Duration::from_micros(200);

/// One published job: `tasks` calls of `f`, claimed through `next`, counted in `done`.
struct Job {
    /// The caller's closure with its lifetime erased: valid while the job is published and
    /// until `active` drains (see the module docs).
    f: *const (dyn Fn(usize) + Sync + 'static),
    tasks: usize,
    next: AtomicUsize,
    /// On its own cache line: every finished task bumps it while others claim from `next`.
    done: CacheLine<AtomicUsize>,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

#[repr(align(128))]
struct CacheLine<T>(T);

impl Job {
    /// Claims and runs tasks until none are left; returns whether it ran any.
    fn work(&self) -> bool {
        let mut ran = false;
        loop {
            let i = self.next.fetch_add(1, Relaxed);
            if i >= self.tasks {
                return ran;
            }
            // SAFETY: `f` is live while this job can be reached (module docs).
            let f = unsafe { &*self.f };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| super::par::run_task(f, i))) {
                let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none() {
                    *first = Some(p);
                } else {
                    // A later payload is dropped here, where a panicking Drop cannot
                    // escape and leave the job half drained.
                    drop(first);
                    let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
                }
            }
            self.done.0.fetch_add(1, Release);
            ran = true;
        }
    }
}

struct Shared {
    job: AtomicPtr<Job>,
    /// Bumped after each job is published: workers spin on it with plain loads (no
    /// read-modify-write on a shared line while idle) and join each job once.
    epoch: AtomicU64,
    /// Workers between counting themselves in and finishing with the job they read.
    active: AtomicUsize,
    sleepers: AtomicUsize,
    /// The condvar's lock (parked workers wait for a new epoch).
    park: Mutex<()>,
    wake: Condvar,
}

/// The team: `workers` threads besides the caller, one job at a time.
pub(crate) struct Team {
    workers: usize,
    shared: Arc<Shared>,
    busy: Mutex<()>,
}

impl Team {
    fn new(workers: usize) -> Self {
        let shared = Arc::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            epoch: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 0..workers {
            let s = Arc::clone(&shared);
            // A team that cannot start all its threads still works with fewer: the caller
            // and whoever started claim every task.
            let _ = std::thread::Builder::new().name(format!("tessera-cpu-team-{i}")).spawn(move || worker(&s));
        }
        Team { workers, shared, busy: Mutex::new(()) }
    }

    /// Runs `task(i)` for `i` in `0..tasks` on the team and the calling thread. Returns
    /// `false` without running anything when the team is busy with another caller's job.
    pub(crate) fn try_run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) -> bool {
        // Poisoned only by a task's panic re-raised here earlier: the team is fine.
        let _one_job = match self.busy.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        // SAFETY: only the lifetime changes; the job is withdrawn and drained before this
        // function returns (module docs), so no thread uses `f` after `task` dies.
        let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(task) };
        let job =
            Job { f, tasks, next: AtomicUsize::new(0), done: CacheLine(AtomicUsize::new(0)), panic: Mutex::new(None) };
        let s = &*self.shared;
        s.job.store(&job as *const Job as *mut Job, SeqCst);
        // From here until this guard drops (also if anything below unwinds) the job is
        // withdrawn and drained before `job` goes out of scope.
        let withdraw = Withdraw(s);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _lock = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        job.work();
        wait_until(|| job.done.0.load(Acquire) >= tasks);
        drop(withdraw);
        if let Some(p) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
        true
    }

    /// Threads besides the caller.
    pub(crate) fn workers(&self) -> usize {
        self.workers
    }
}

/// Withdraws the published job and waits until no worker holds it (see the module docs).
struct Withdraw<'a>(&'a Shared);

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        self.0.job.store(std::ptr::null_mut(), SeqCst);
        wait_until(|| self.0.active.load(SeqCst) == 0);
    }
}

/// Spins until `done()`, yielding the core after a while (a worker the OS preempted in
/// the middle of a task must get to run).
fn wait_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins = spins.saturating_add(1);
        if spins < 4096 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        let epoch = s.epoch.load(SeqCst);
        if epoch != seen {
            s.active.fetch_add(1, SeqCst);
            let p = s.job.load(SeqCst);
            if !p.is_null() {
                // SAFETY: a published job stays valid until `active` drains (module docs).
                unsafe { &*p }.work();
            }
            s.active.fetch_sub(1, SeqCst);
            seen = epoch;
            idle_since = Instant::now();
            continue;
        }
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(256) || idle_since.elapsed() < IDLE_PARK {
            continue;
        }
        // Park until a caller publishes a job (it notifies when anyone sleeps).
        let mut lock = s.park.lock().unwrap_or_else(|e| e.into_inner());
        s.sleepers.fetch_add(1, SeqCst);
        while s.epoch.load(SeqCst) == seen {
            lock = s.wake.wait(lock).unwrap_or_else(|e| e.into_inner());
        }
        s.sleepers.fetch_sub(1, SeqCst);
        drop(lock);
        idle_since = Instant::now();
    }
}

/// The process's team, sized for the global rayon pool (whatever thread first asks; its
/// threads live as long as the process).
pub(crate) fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        // A thread outside every pool sees the global pool's size.
        let global = std::thread::scope(|s| s.spawn(rayon::current_num_threads).join()).unwrap_or(1);
        Team::new(global.saturating_sub(1))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Many jobs back to back, of every size around the team's width, each task exactly
    /// once; then after the workers have parked, a job still runs everywhere.
    #[test]
    fn every_task_runs_once_across_many_jobs_and_after_parking() {
        let team = Team::new(3);
        for round in 0..2000usize {
            let tasks = round % 9;
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            assert!(team.try_run(tasks, &|i| {
                hits[i].fetch_add(1, Relaxed);
            }));
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "round {round}");
        }
        std::thread::sleep(IDLE_PARK * 10);
        let threads = Mutex::new(std::collections::HashSet::new());
        assert!(team.try_run(64, &|_| {
            threads.lock().unwrap().insert(std::thread::current().id());
            std::thread::sleep(Duration::from_millis(2));
        }));
        assert!(threads.into_inner().unwrap().len() > 1, "parked workers woke for the job");
    }

    /// A panicking task reaches the caller after the job drained, and the team still works.
    #[test]
    fn a_task_panic_reaches_the_caller_and_the_team_goes_on() {
        let team = Team::new(2);
        let done = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.try_run(16, &|i| {
                assert!(i != 5, "task 5 fails");
                done.fetch_add(1, Relaxed);
            })
        }));
        assert!(r.is_err());
        assert_eq!(done.load(Relaxed), 15, "every other task ran");
        let n = AtomicU32::new(0);
        assert!(team.try_run(10, &|_| {
            n.fetch_add(1, Relaxed);
        }));
        assert_eq!(n.load(Relaxed), 10);
    }

    /// Two callers at once: one gets the team, the other is told to go elsewhere.
    #[test]
    fn a_busy_team_refuses_a_second_caller() {
        let team = Team::new(1);
        let inner = AtomicU32::new(0);
        assert!(team.try_run(2, &|i| {
            if i == 0 {
                let refused = !team.try_run(1, &|_| {});
                inner.store(u32::from(refused), Relaxed);
            }
        }));
        assert_eq!(inner.load(Relaxed), 1);
    }
}
