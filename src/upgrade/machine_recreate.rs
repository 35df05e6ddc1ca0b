//! The recreate path's steps where they differ from in place: at sandbox granularity. The old
//! sandbox keeps running with its containers stopped until the commit (unless host ports on
//! the pod network force it to stop), so a rollback restores the old revision in it, with its
//! address and volumes.

use super::{
    rollback_overdue, unready, Journal, Observed, Pod, Run, Sandboxes, State, Step, StopFirst,
};

/// `None` defers to the shared rules (Pulling, Verifying, Verified, terminal states).
pub(super) fn next(j: &Journal, o: &Observed, sb: &Sandboxes, overdue: bool) -> Option<Step> {
    fn ready(p: &Option<Pod>) -> Option<&Pod> {
        p.as_ref().filter(|p| p.ready)
    }
    fn running(p: &Option<Pod>) -> Option<&Pod> {
        p.as_ref().filter(|p| p.ready && p.running)
    }
    Some(match j.state {
        State::Swapping => {
            if overdue {
                return Some(Step::Go(
                    State::RollingBack,
                    Some("the new pod did not start in time".into()),
                ));
            }
            if let Some(why) = &o.target_unavailable {
                return Some(Step::Go(
                    State::RollingBack,
                    Some(format!("the target revision cannot run: {why}")),
                ));
            }
            match sb.stop_first {
                StopFirst::Sandbox => {
                    if let Some(old) = ready(&sb.old) {
                        return Some(Step::StopPod(old.id.clone()));
                    }
                }
                StopFirst::Containers => {
                    if let Some(old) = running(&sb.old) {
                        return Some(Step::StopContainers(old.id.clone()));
                    }
                }
                StopFirst::Nothing => {}
            }
            if ready(&sb.new).is_none() {
                return Some(match &sb.new {
                    // A new sandbox that died: start over from a clean one.
                    Some(dead) => Step::RemovePod(dead.id.clone()),
                    None => Step::CreatePod,
                });
            }
            // Init containers first, one at a time, each to success.
            for p in &o.inits {
                match &p.new {
                    None => return Some(Step::CreateNew(p.name.clone())),
                    Some(n) if n.state == Run::Created => return Some(Step::Start(n.id.clone())),
                    Some(n) if n.state == Run::Exited && n.exit_code == 0 => continue,
                    Some(n) if n.state == Run::Exited => {
                        return Some(Step::Go(
                            State::RollingBack,
                            Some(format!(
                                "new init container {} exited with code {}",
                                p.name, n.exit_code
                            )),
                        ))
                    }
                    Some(_) => return Some(Step::Wait),
                }
            }
            for p in &o.pairs {
                match &p.new {
                    None => return Some(Step::CreateNew(p.name.clone())),
                    Some(n) if n.state == Run::Exited => {
                        return Some(Step::Go(
                            State::RollingBack,
                            Some(format!(
                                "new container {} exited with code {}",
                                p.name, n.exit_code
                            )),
                        ))
                    }
                    Some(n) if n.state == Run::Created => return Some(Step::Start(n.id.clone())),
                    Some(_) => {}
                }
            }
            // The old pod's containers stop; its sandbox stays for a rollback until the
            // commit removes it.
            match running(&sb.old) {
                Some(old) => Step::StopContainers(old.id.clone()),
                None => Step::Go(State::Verifying, None),
            }
        }
        State::Committed => match &sb.old {
            Some(old) if !overdue => Step::RemovePod(old.id.clone()),
            _ => Step::Go(State::Done, None),
        },
        State::RollingBack => {
            if overdue {
                return Some(Step::Go(State::Failed, Some(rollback_overdue(&o.restore))));
            }
            if let Some(new) = &sb.new {
                return Some(Step::RemovePod(new.id.clone()));
            }
            match &sb.old {
                // Kept: the old revision runs again in it, and is verified.
                Some(old) if old.ready => {
                    for p in &o.restore {
                        match &p.old {
                            Some(c) if c.state == Run::Running => {}
                            Some(c) if c.state == Run::Created => {
                                return Some(Step::Start(c.id.clone()))
                            }
                            // Nothing to restore it from until the old revision's inputs are
                            // back; the deadline ends the wait.
                            _ if o.old_unavailable.is_some() => return Some(Step::Wait),
                            c => {
                                return Some(Step::RestoreOld {
                                    name: p.name.clone(),
                                    replace: c.as_ref().map(|c| c.id.clone()),
                                })
                            }
                        }
                    }
                    if unready(&o.restore).next().is_some() {
                        return Some(Step::Wait);
                    }
                    Step::Go(State::RolledBack, None)
                }
                // A stopped old sandbox cannot run again: it goes, and the runtime starts the
                // pod afresh from the old spec once the engine lets go of it.
                Some(old) => Step::RemovePod(old.id.clone()),
                None => Step::Go(State::RolledBack, None),
            }
        }
        _ => return None,
    })
}
