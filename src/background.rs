//! Work no one waits for yet runs in the background, and moves to the foreground once
//! someone waits for it (decode ahead, check ahead, a hash's reader).
//!
//! Background is `SCHED_IDLE` rather than nice 19: a nice 19 thread still takes a share of
//! a busy core, and an engine importing beside decode ahead on two cores took 1.09x its
//! time alone at nice 19, 1.04x under `SCHED_IDLE` (docs/PERFORMANCE-LOG.md, "Engines"). Where a
//! thread may not leave `SCHED_IDLE` again, nice 19. A failure costs speed, not correctness.

use std::sync::OnceLock;

/// Put thread `tid` in the background or back in the foreground.
pub fn run_in_background(tid: libc::pid_t, background: bool) {
    if Background::chosen() == Background::Nice {
        // SAFETY: setpriority on one thread id; on Linux PRIO_PROCESS with a thread id
        // affects that thread alone.
        unsafe {
            libc::setpriority(
                libc::PRIO_PROCESS,
                tid as libc::id_t,
                if background { 19 } else { 0 },
            )
        };
        return;
    }
    let policy = if background {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler on one thread id with a valid parameter; on Linux a thread
    // id names that thread alone.
    unsafe { libc::sched_setscheduler(tid, policy, &param) };
}

/// Put the calling thread where thread `leader` is, background or foreground: a helper
/// started by a thread that runs in the background inherits its policy, but only the
/// thread that started it is moved when it is urged. Cheap enough to ask before each
/// piece of work.
pub fn follow(leader: libc::pid_t) {
    let (policy, nice) = place_of(leader);
    let background = match Background::chosen() {
        Background::Idle if policy >= 0 => policy == libc::SCHED_IDLE,
        Background::Nice => nice >= 19,
        // The leader is gone: stay as it last was.
        Background::Idle => return,
    };
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    run_in_background(me, background);
}

/// How this process keeps work in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Background {
    /// `SCHED_IDLE`, and back to `SCHED_OTHER` when urged.
    Idle,
    /// nice 19, where a thread may not leave `SCHED_IDLE` again (no `CAP_SYS_NICE` and an
    /// `RLIMIT_NICE` below 20, as in a container given only `SYS_ADMIN`): urged work then
    /// keeps a share of a busy core, where under `SCHED_IDLE` it would keep almost none.
    Nice,
}

impl Background {
    pub fn chosen() -> Background {
        static CHOSEN: OnceLock<Background> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            if may_leave_sched_idle() {
                Background::Idle
            } else {
                log::debug!("work ahead at nice 19: threads may not leave SCHED_IDLE here");
                Background::Nice
            }
        })
    }
}

/// Whether a thread of this process can enter `SCHED_IDLE` and leave it again: tried on a
/// thread of its own, which then ends.
fn may_leave_sched_idle() -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    let probe = move || {
        // SAFETY: sched_setscheduler(0, ...) changes the calling (probe) thread alone.
        unsafe {
            libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) == 0
                && libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) == 0
        }
    };
    std::thread::Builder::new()
        .name("kllm-sched-probe".into())
        .spawn(probe)
        .ok()
        .and_then(|t| t.join().ok())
        .unwrap_or(false)
}

/// Thread `tid`'s place: its scheduling policy (negative if the thread is gone) and nice
/// value.
pub fn place_of(tid: libc::pid_t) -> (i32, i32) {
    // SAFETY: sched_getscheduler and getpriority read one thread's policy and nice value.
    unsafe {
        (
            libc::sched_getscheduler(tid),
            libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t),
        )
    }
}

/// The place ([`place_of`]) of a thread this process keeps in the background.
#[cfg(test)]
pub(crate) fn background_place() -> (i32, i32) {
    match Background::chosen() {
        Background::Idle => (libc::SCHED_IDLE, 0),
        Background::Nice => (libc::SCHED_OTHER, 19),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A helper that follows its leader goes to the background and back with it.
    #[test]
    fn a_follower_takes_its_leaders_place() {
        let (to_leader, leader_rx) = std::sync::mpsc::channel::<()>();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let leader = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            while leader_rx.recv().is_ok() {}
        });
        let leader_tid = tid_rx.recv().unwrap();
        let follower = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            let me = unsafe { libc::gettid() };
            let mut seen = Vec::new();
            for background in [true, false] {
                run_in_background(leader_tid, background);
                follow(leader_tid);
                seen.push((place_of(leader_tid), place_of(me)));
            }
            seen
        });
        let seen = follower.join().unwrap();
        drop(to_leader);
        leader.join().unwrap();
        let background = background_place();
        assert_eq!(seen[0], (background, background), "(leader, follower)");
        assert_eq!(seen[1].0, seen[1].1, "urged: (leader, follower)");
        if Background::chosen() == Background::Idle {
            assert_eq!(seen[1].1, (libc::SCHED_OTHER, 0));
        }
    }
}
