//! A team of spinning threads for the CPU step's many small parallel ops (the default
//! dispatch, see `par.rs`).
//!
//! Why: a decode step on many cores is a few hundred ops of a few microseconds each, and
//! waking rayon's threads for each (a broadcast, then a latch) costs about as much as the
//! op. The team's threads instead watch one epoch counter and join each job the caller
//! publishes; the caller works too, then spins until every task has finished. A thread
//! that has seen no job for [`IDLE_PARK`] parks on a condvar, so an idle worker (between
//! requests) costs nothing.
//!
//! Every thread has a slot on its own cache line: its share of the tasks (a contiguous
//! range, claimed through the slot's counter), how many tasks it has finished, and
//! whether it is inside a job. A thread claims from its own range, then steals from the
//! others' one task at a time, so a late or preempted thread's share still gets done.
//! Nothing is read-modify-written on a line every thread shares: on the 16-core Xeon the
//! team that claimed every task from one shared counter and counted it in another took
//! 6.1 µs for an op of 16 empty tasks and 11.1 µs for 64; this one 4.2 and 4.5
//! (`par_bench`, bench/RESULTS.md, on different machines of the kind).
//!
//! Protocol (every access to `job`, `epoch` and a slot's `inside` is SeqCst, except the
//! store that lowers `inside`, a release): the caller sets the slots' ranges, publishes
//! `job`, then bumps `epoch`; a worker that sees a new epoch raises its `inside`, then
//! reads `job` (whatever job it finds is one it may work on, its slots already set); the
//! caller, once the slots' finished counts add up to the tasks, clears `job`, then waits
//! until no `inside` is raised. So no worker can still hold a job whose frame the caller
//! is about to leave. A task's panic is caught on its thread and re-raised on the
//! caller's once the job has drained.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long a worker spins without a job before it parks.
const IDLE_PARK: Duration = Duration::from_micros(200);

/// One published job: `tasks` calls of `f`, spread over the team's slots.
struct Job {
    /// The caller's closure with its lifetime erased: valid while the job is published and
    /// until every slot's `inside` is lowered (see the module docs).
    f: *const (dyn Fn(usize) + Sync + 'static),
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// One thread's share of the current job (the caller is slot 0, worker `i` slot `i + 1`).
#[repr(align(128))]
struct Slot {
    /// The next task of this slot's range to claim (past `end` once it is used up).
    next: AtomicUsize,
    /// The end of this slot's range.
    end: AtomicUsize,
    /// Tasks this slot's thread finished in the current job (its own and stolen ones).
    finished: AtomicUsize,
    /// Raised while this slot's worker may hold the job (the module docs' protocol).
    inside: AtomicBool,
}

impl Slot {
    fn new() -> Self {
        Slot {
            next: AtomicUsize::new(0),
            end: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            inside: AtomicBool::new(false),
        }
    }

    /// Claims one task of this slot's range, if any is left.
    fn claim(&self) -> Option<usize> {
        let end = self.end.load(Relaxed);
        // A load first: stealers that find the range used up leave its line alone.
        if self.next.load(Relaxed) >= end {
            return None;
        }
        let i = self.next.fetch_add(1, Relaxed);
        (i < end).then_some(i)
    }
}

impl Job {
    /// Runs tasks from slot `me`'s range, then stolen from the others, until none are
    /// left; counts each finished one in `me`'s slot.
    fn work(&self, s: &Shared, me: usize) {
        let slots = &s.slots;
        // SAFETY: `f` is live while this job can be reached (module docs).
        let f = unsafe { &*self.f };
        // Only this thread writes its count during a job (the caller reset it before
        // publishing); a worker can enter the same job twice (a late look at an older epoch
        // finds this job), so it counts on from there.
        let mut done = slots[me].finished.load(Relaxed);
        for k in 0..slots.len() {
            let j = (me + k) % slots.len();
            if k > 0 && s.used_up(j).load(Relaxed) {
                continue;
            }
            let from = &slots[j];
            while let Some(i) = from.claim() {
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| super::par::run_task(f, i))) {
                    self.keep_panic(p);
                }
                done += 1;
                slots[me].finished.store(done, Release);
            }
            // A plain store (the thread goes on while its line travels): later stealers
            // skip this range without reading its counter's line.
            s.used_up(j).store(true, Relaxed);
        }
    }

    fn keep_panic(&self, p: Box<dyn Any + Send>) {
        let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = Some(p);
        } else {
            // A later payload is dropped here, where a panicking Drop cannot escape and
            // leave the job half drained.
            drop(first);
            let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
        }
    }
}

struct Shared {
    job: AtomicPtr<Job>,
    /// Bumped after each job is published: workers spin on it with plain loads (no
    /// read-modify-write on a shared line while idle) and join each job once.
    epoch: AtomicU64,
    /// The caller's slot, then one per worker.
    slots: Box<[Slot]>,
    /// Whether each slot's range is used up, 64 slots to a cache line: a thread done with
    /// its own range reads these few lines instead of every other slot's. The caller
    /// lowers them all before publishing a job; a flag is raised only by a thread inside
    /// the job (whose `inside` the caller waited on before the next reset), once a claim
    /// found the range empty, so a raised flag never hides tasks.
    used_up: Box<[CacheLine<[AtomicBool; 64]>]>,
    sleepers: AtomicUsize,
    /// The condvar's lock (parked workers wait for a new epoch).
    park: Mutex<()>,
    wake: Condvar,
}

impl Shared {
    fn used_up(&self, slot: usize) -> &AtomicBool {
        &self.used_up[slot / 64].0[slot % 64]
    }
}

#[repr(align(128))]
struct CacheLine<T>(T);

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
            slots: (0..=workers).map(|_| Slot::new()).collect(),
            used_up: (0..(workers + 1).div_ceil(64))
                .map(|_| CacheLine(std::array::from_fn(|_| AtomicBool::new(false))))
                .collect(),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 0..workers {
            let s = Arc::clone(&shared);
            // A team that cannot start all its threads still works with fewer: the caller
            // and whoever started steal the missing threads' shares.
            let _ = std::thread::Builder::new().name(format!("tessera-cpu-team-{i}")).spawn(move || worker(&s, i + 1));
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
        let job = Job { f, panic: Mutex::new(None) };
        let s = &*self.shared;
        // Contiguous shares, the caller's first. No worker works on a job here (the last
        // one drained); one that enters now, on a stale epoch, reads `job` after these
        // stores, so it finds null or this job with its shares set.
        let n = s.slots.len();
        let bound = |k: usize| (k as u128 * tasks as u128 / n as u128) as usize;
        for (k, slot) in s.slots.iter().enumerate() {
            slot.next.store(bound(k), Relaxed);
            slot.end.store(bound(k + 1), Relaxed);
            slot.finished.store(0, Relaxed);
            s.used_up(k).store(false, Relaxed);
        }
        s.job.store(&job as *const Job as *mut Job, SeqCst);
        // From here until this guard drops (also if anything below unwinds) the job is
        // withdrawn and drained before `job` goes out of scope.
        let withdraw = Withdraw(s);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _lock = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        job.work(s, 0);
        wait_until(|| s.slots.iter().map(|x| x.finished.load(Acquire)).sum::<usize>() >= tasks);
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
        wait_until(|| self.0.slots[1..].iter().all(|x| !x.inside.load(SeqCst)));
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

/// Worker `me` (its slot's index).
fn worker(s: &Shared, me: usize) {
    let slot = &s.slots[me];
    let mut seen = 0u64;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        let epoch = s.epoch.load(SeqCst);
        if epoch != seen {
            slot.inside.store(true, SeqCst);
            let p = s.job.load(SeqCst);
            if !p.is_null() {
                // SAFETY: a published job stays valid while `inside` is raised (module docs).
                unsafe { &*p }.work(s, me);
            }
            // Release, not SeqCst: the caller that reads this `false` sees everything the
            // worker did with the job; no later load of the worker's needs to wait for
            // it (a SeqCst store would drain its stores, the shares' flag among them,
            // while their lines are still on their way).
            slot.inside.store(false, Release);
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

    /// A thread held up in one task does not hold up the rest of its share: task 0 (the
    /// first of the caller's share, unless a worker stole it first) waits until every
    /// other task has run, which needs the other threads to take the rest of that share.
    #[test]
    fn a_held_up_threads_share_is_stolen() {
        let team = Team::new(3);
        let tasks = 40;
        let others = AtomicU32::new(0);
        let saw_all = AtomicU32::new(0);
        assert!(team.try_run(tasks, &|i| {
            if i == 0 {
                let t = Instant::now();
                while others.load(Relaxed) < tasks as u32 - 1 && t.elapsed() < Duration::from_secs(10) {
                    std::hint::spin_loop();
                }
                saw_all.store(others.load(Relaxed), Relaxed);
            } else {
                others.fetch_add(1, Relaxed);
            }
        }));
        assert_eq!(saw_all.load(Relaxed), tasks as u32 - 1);
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
