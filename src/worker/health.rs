//! Sink health: whether a failure is the event's fault or the sink's, judged from evidence.
//!
//! A sink is `healthy` or `suspended` (an admin's `outbox.pause_sink` makes it `disabled`,
//! which the worker sees as the sink being gone). A failed request counts against its events
//! (an attempt spent, a key parked, at last a dead letter) only when the sink is shown healthy
//! for other events:
//! - some request of the same batch was delivered (a partial success; but failures after the
//!   batch's last delivery, of two keys or more, are not counted: a receiver that starts
//!   refusing everything mid-batch looks just so), or
//! - the sink delivered something since each failed event last failed as about itself (its
//!   earlier failure was remembered here; an event only throttled before, or one failing for
//!   the first time beside it, shows nothing, and nor does a failure of a batch of two keys
//!   or more that nothing showed healthy: a receiver flapping between up and down fails
//!   whatever comes in its down spells; a batch with nothing to count is settled
//!   uncounted, not given back, when any of its events failed before with a success since), or
//! - the failed request carried one key's events, the sink answered it as about those events
//!   (a retry or a refusal: src/sinks/http.rs judge_failure), delivered other events within
//!   the last 30 s, no other key has been answered so since, and the sink is not suspended:
//!   a poisoned key on a sink that is otherwise idle is still dead-lettered. On this evidence
//!   alone (and for one key's failures after a batch's last delivery) a refusal counts as a
//!   retry, not as final: a deploy answering 400 to everything looks the same to the only key
//!   it is sent, whose events would otherwise be dead-lettered one after the other. (Not so a record a Kafka broker refuses:
//!   the Kafka sinks blame it only once its topic takes another record, src/sinks/evidence.rs,
//!   so on an idle topic it waits, uncounted.) (One key's events failing alone within 30 s of a
//!   success is all that tells the two apart; a sink with a single key in flight can so have
//!   its attempts counted in the first 30 s of an outage.)
//!
//! A request of the sink that started after the failed batch and delivered something shows the
//! sink takes other events, but not that the failure is the events': the receiver may have
//! begun failing (a deploy answering 400 to everything) after that request was answered and
//! before the batch's was. So the batch is settled with its failures uncounted (`Unsent`: the
//! sink is not suspended, its keys wait in order) and remembered: failing so again after a
//! success, they are the events'.
//!
//! An event found unsendable before it reached the sink (`Verdict::Invalid`: a topic name
//! Kafka refuses, a record over the client's own size limit) is dead-lettered whatever the
//! sink's health. What the sink itself refuses, even as too large, is judged as above: a
//! limit lowered by mistake refuses every event, which suspends the sink.
//!
//! Otherwise the batch is given back unattempted (`outbox.release`): nothing is counted,
//! parked or dead-lettered, however long the failure lasts, and the sink is suspended: no
//! claims but one probe at a time (batches already out go on; the first that delivers
//! anything ends the suspension, so a poisoned batch among healthy ones costs little), a
//! small batch sent one event per request, on a backoff (0.25 s doubling to 2 s, or the
//! sink's Retry-After clamped to 0.1 s .. 5 min). The first probe that delivers anything
//! resumes the sink at full concurrency; its failed events are then blamed as usual (but one
//! that found the sink down: a probe goes on past it, sinks::Tally, and it waits uncounted,
//! remembered as failing about itself: probe_past_down). A probe
//! that could test only one key, because that key's events were all the sink had to send (say
//! a poisoned key is the first thing a new sink is sent, and the events behind it are in the
//! same shard), lets that key wait uncounted instead of giving it back: given back, the next
//! probe would find the same key again, for ever. (So a sink that is down with a single key
//! to deliver shows that key parked, with no attempt counted.)
//!
//! What the sinks say of a failure is a hint only: `Verdict::Unsent` (throttling, a topic the
//! cluster lacks, a credential it refuses, no report in time) is never counted, even on a
//! healthy sink; its key waits, in order, without an attempt. Nor is a request that found the
//! sink down for a reason nothing it carried can cause (`Verdict::Down` not `blameable`: no
//! connection, DNS or TLS session, our credentials refused, a Kafka REST proxy failing): on a
//! healthy sink it is one bad instance of the receiver's several, and its events wait.
//!
//! Example: a receiver answering 401 to everything gets every batch back and the sink
//! suspended; `outbox.status` shows `sink_state = 'suspended'` with the 401 as the reason;
//! once the credential is fixed (`UPDATE outbox.sinks SET http_headers = ...`) the worker
//! starts afresh and delivers at once.

use super::pool::Batch;
use crate::sinks::http::RETRY_AFTER_MAX;
use crate::sinks::{Outcome, Verdict};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

/// The first probe of a suspended sink comes after this; each failed probe doubles it.
/// Short, so that a sink fixed outside our view (a receiver back, a topic made) is delivered to
/// within about 2 s; a probe of a sink that is down is one small request (two when the first
/// may be its event's doing: sinks::Tally), so even a sink down for hours costs little.
const FIRST_PROBE: Duration = Duration::from_millis(250);
const MAX_PROBE_DELAY: Duration = Duration::from_secs(2);
/// A suspended sink's Retry-After is honoured from this on, up to RETRY_AFTER_MAX (which
/// parked keys get too).
const RETRY_AFTER_MIN: Duration = Duration::from_millis(100);
/// A sink throttled partway through a batch gets no new claims for this long, unless it said.
const SLOW_DOWN: Duration = Duration::from_secs(1);
/// A probe claims at most this many events, and sends each in a request of its own.
pub const PROBE_EVENTS: i32 = 10;
/// Failures remembered per sink (the oldest are forgotten first).
const SUSPECTS_MAX: usize = 10_000;
/// A lone key failing within this of the sink's last success is taken to be at fault.
const LONE_KEY_WINDOW: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Healthy,
    Suspended(Suspension),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Suspension {
    pub reason: String,
    pub since: SystemTime,
    pub next_probe: Instant,
    delay: Duration,
}

impl Suspension {
    /// When the next probe goes, as a wall-clock time (for outbox.status).
    pub fn next_probe_at(&self) -> SystemTime {
        let left = self.next_probe.saturating_duration_since(Instant::now());
        SystemTime::now() + left
    }
}

/// What to do with a finished batch.
#[derive(Debug, PartialEq)]
pub enum Judgement {
    /// Settle it with these verdicts: its failures are the events' (or, unsent, nobody's).
    Settle(Vec<Verdict>),
    /// Give it back unattempted, to be claimed again at once: the suspension holds the claims
    /// back, not the shard, so that a fixed sink row (or resume_sink) delivers at once.
    GiveBack { error: String },
}

/// What shows a failed batch's failures to be its events' (Health::evidence).
#[derive(Debug, PartialEq)]
enum Evidence {
    /// Theirs: each failed before, answered as about itself, and the sink delivered since (or
    /// the failure is certain).
    TheirOwn,
    /// Only a request started after the batch's that delivered: the sink takes other events,
    /// but may have begun failing since that request was answered. Not counted.
    OthersDelivered,
    /// One key failing alone soon after a success, no other key since (lone_key_failing): a
    /// poisoned key's look, but also a sink that began refusing everything, seen by the only
    /// key it was sent. Counted, never final: a refusal is retried, and final only once the
    /// event is refused again after the sink delivered something (TheirOwn).
    LoneKey,
    /// Nothing: as far as anyone knows, the sink is failing.
    Nothing,
}

/// What the worker may claim for the sink now.
#[derive(Debug, PartialEq)]
pub enum Claims {
    Full,
    /// One probe batch (PROBE_EVENTS, one event per request).
    Probe,
    None,
}

#[derive(Debug)]
pub struct Health {
    pub state: State,
    /// When the newest request that delivered something started, and when it was judged.
    last_success_start: Option<Instant>,
    last_success_at: Option<Instant>,
    /// Keys the sink answered as about their events since the last success, blamed or not
    /// (two at most: enough to say "not one key").
    failing_keys: Vec<String>,
    /// Events that failed, when, and whether the sink answered as about the event (not only
    /// throttled or unsent): the sink delivering anything since shows the next failure of the
    /// same event, answered so again, to be the event's.
    suspects: HashMap<String, (Instant, bool)>,
    /// The probe out: (shard, epoch).
    probe: Option<(i32, i64)>,
    /// The probe holds one key's events and the sink had nothing else to claim.
    lone_probe: bool,
    /// A throttling sink: no new claims before this.
    slowed_until: Option<Instant>,
    /// Suspensions so far (for the metrics).
    pub suspensions: u64,
    /// The state changed since the last call of `take_changed` (to be written and logged).
    changed: bool,
}

impl Default for Health {
    fn default() -> Health {
        Health {
            state: State::Healthy,
            last_success_start: None,
            last_success_at: None,
            failing_keys: Vec::new(),
            suspects: HashMap::new(),
            probe: None,
            lone_probe: false,
            slowed_until: None,
            suspensions: 0,
            changed: false,
        }
    }
}

impl Health {
    /// The sink's row changed (a credential fixed, a URL moved): start afresh, at full
    /// concurrency, keeping only the count of suspensions.
    pub fn reset(&mut self) {
        if self.state != State::Healthy {
            self.changed = true;
        }
        *self = Health {
            suspensions: self.suspensions,
            changed: self.changed,
            ..Health::default()
        };
    }

    pub fn claims(&self, now: Instant, in_flight: usize) -> Claims {
        match &self.state {
            State::Healthy if self.slowed_until.is_some_and(|t| t > now) => Claims::None,
            State::Healthy => Claims::Full,
            State::Suspended(s)
                if s.next_probe <= now && in_flight == 0 && self.probe.is_none() =>
            {
                Claims::Probe
            }
            State::Suspended(_) => Claims::None,
        }
    }

    /// When the worker should look again at a sink that may not claim now.
    pub fn wake_at(&self) -> Option<Instant> {
        match &self.state {
            State::Suspended(s) => Some(s.next_probe),
            State::Healthy => self.slowed_until,
        }
    }

    /// A probe went out; `lone`: it holds one key's events and there was nothing else to claim.
    pub fn probe_sent(&mut self, batch: &Batch, lone: bool) {
        self.probe = Some((batch.shard, batch.epoch));
        self.lone_probe = lone;
    }

    /// No probe could be claimed (nothing to deliver): try again after the same delay.
    pub fn probe_found_nothing(&mut self, now: Instant) {
        if let State::Suspended(s) = &mut self.state {
            s.next_probe = now + s.delay;
        }
    }

    pub fn is_probe(&self, batch: &Batch) -> bool {
        self.probe == Some((batch.shard, batch.epoch))
    }

    /// Judges a finished batch: `started` is when its delivery began.
    pub fn judge(&mut self, batch: &Batch, outcome: Outcome, started: Instant) -> Judgement {
        let now = Instant::now();
        let was_probe = self.is_probe(batch);
        if was_probe {
            self.probe = None;
        }
        let verdicts = outcome.into_verdicts(batch.events.len());
        if verdicts.contains(&Verdict::Delivered) && verdicts.iter().any(is_down) {
            return self.probe_past_down(batch, verdicts, started, now);
        }
        if let Some((error, retry_after)) = verdicts.iter().find_map(down) {
            // the sink was found down with nothing of the batch through (sinks::Tally): only
            // the events that request carried are blamed, only if the sink is shown healthy,
            // and only for a failure they may have caused (blamed); the others (heads to go
            // alone, routed away) keep their verdicts
            // with them, the batch's events the sink answered about before it was found down
            // (a webhook's single events, earlier Kafka REST rounds): theirs only if each is
            let answered: Vec<&crate::sinks::Event> = (batch.events.iter().zip(&verdicts))
                .filter(|(_, v)| is_down(v) || about_the_event(v))
                .map(|(e, _)| e)
                .collect();
            let answered_ids: Vec<&str> = answered.iter().map(|e| e.id.as_str()).collect();
            let evidence = self.evidence(started, &answered_ids, &answered_ids);
            // (a batch of two keys or more failing on a sink found down is no evidence against
            // its events later: a receiver flapping between up and down fails whatever comes in
            // its down spells; one key's events failing so may be a poisoned key's)
            let one_key = answered
                .windows(2)
                .all(|w| w[0].aggregate_id == w[1].aggregate_id);
            let evidence_later = evidence != Evidence::Nothing || one_key;
            // (a failure nothing it carried can cause, no connection or our credentials
            // refused, says nothing about an event, then or later)
            let could_be_theirs = |v: &Verdict| {
                about_the_event(v)
                    || matches!(
                        v,
                        Verdict::Down {
                            blameable: true,
                            ..
                        }
                    )
            };
            let remembered = (batch.events.iter().zip(&verdicts))
                .filter(|(_, v)| is_down(v) || about_the_event(v))
                .map(|(e, v)| (e.id.as_str(), evidence_later && could_be_theirs(v)));
            self.remember(remembered, now);
            match evidence {
                Evidence::TheirOwn => {
                    return Judgement::Settle(verdicts.into_iter().map(blamed).collect())
                }
                Evidence::OthersDelivered => {
                    return Judgement::Settle(
                        verdicts.into_iter().map(Verdict::uncounted).collect(),
                    )
                }
                // (LoneKey is made only for a batch the sink answered, below)
                Evidence::LoneKey | Evidence::Nothing => {}
            }
            self.note_failing(answered.iter().map(|e| e.aggregate_id.as_str()));
            // (a probe that went on past a Down may have been asked to wait after it)
            let asked = verdicts.iter().find_map(unsent_retry_after).flatten();
            return self.give_back(error, retry_after.or(asked), was_probe, now);
        }
        if verdicts.contains(&Verdict::Delivered) {
            return self.partly_delivered(batch, verdicts, started, now);
        }
        // what the sink said of each key's first failure (a held-back event says nothing)
        let said: Vec<(&crate::sinks::Event, &Verdict)> = (batch.events.iter().zip(&verdicts))
            .filter(|(_, v)| v.is_failure() && **v != Verdict::HeldBack)
            .collect();
        let failed: Vec<&str> = said.iter().map(|(e, _)| e.id.as_str()).collect();
        let about = answered_about(batch, &verdicts);
        let Some((error, retry_after)) = said.iter().find_map(|(_, v)| failure(v)) else {
            return Judgement::Settle(verdicts); // nothing failed (all skipped by routing)
        };
        let certain = said
            .iter()
            .all(|(_, v)| matches!(v, Verdict::Invalid { .. }));
        let evidence = match self.evidence(started, &failed, &about) {
            _ if certain => Evidence::TheirOwn,
            Evidence::TheirOwn => Evidence::TheirOwn,
            _ if self.lone_key_failing(&said, now) => Evidence::LoneKey,
            other => other,
        };
        let evidence_later = evidence != Evidence::Nothing || one_key_about_it(&said); // as above
        let remembered =
            failures(batch, &verdicts).map(|(id, about)| (id, about && evidence_later));
        self.remember(remembered, now);
        // blamed or not, a key the sink answered as about its events is remembered until the
        // next success: a second key failing alone then is not "a poisoned key" but a sink
        // failing every request
        let about_events = said.iter().filter(|(_, v)| about_the_event(v));
        self.note_failing(about_events.map(|(e, _)| e.aggregate_id.as_str()));
        if evidence != Evidence::Nothing {
            self.throttled(&verdicts, now); // settled, not given back: still asked to wait
        }
        match evidence {
            Evidence::TheirOwn => return Judgement::Settle(verdicts),
            Evidence::LoneKey => {
                return Judgement::Settle(verdicts.into_iter().map(not_final).collect())
            }
            Evidence::OthersDelivered => {
                return Judgement::Settle(verdicts.into_iter().map(Verdict::uncounted).collect())
            }
            Evidence::Nothing => {}
        }
        if was_probe && self.lone_probe && one_key_about_it(&said) {
            // The probe could test nothing but this key (it was all the sink had to send, and
            // its shard's window holds nothing else yet): the key waits, uncounted, so that
            // the shard moves past it and the next probe tests the events behind it. Were the
            // sink down, they fail too, and are given back.
            self.probe_failed(&error, retry_after, now);
            return Judgement::Settle(unsent(verdicts, &error, retry_after));
        }
        self.give_back(error, retry_after, was_probe, now)
    }

    /// A batch that delivered some events: the sink takes events. Its failures are the events'
    /// but for an unproven tail (unproven_tail_unsent).
    fn partly_delivered(
        &mut self,
        batch: &Batch,
        verdicts: Vec<Verdict>,
        started: Instant,
        now: Instant,
    ) -> Judgement {
        let verdicts = unproven_tail_unsent(batch, verdicts, |id| self.refused_before(id));
        self.delivered(started, now);
        self.remember(failures(batch, &verdicts), now);
        self.throttled(&verdicts, now); // what went through is acked, the rest waits
        Judgement::Settle(verdicts)
    }

    /// A probe that went on past an event that found the sink down (sinks::Tally) and then
    /// delivered: the sink takes events again and resumes. The event is its own if it failed
    /// so before with a success since (as in `evidence`); else it waits, uncounted (the sink
    /// may have been coming back just then), remembered as failing about itself before the
    /// probe's delivery: failing so again, it is its own.
    fn probe_past_down(
        &mut self,
        batch: &Batch,
        verdicts: Vec<Verdict>,
        started: Instant,
        now: Instant,
    ) -> Judgement {
        let mut waiting: Vec<String> = Vec::new();
        let mut judged = Vec::with_capacity(verdicts.len());
        for (e, v) in batch.events.iter().zip(verdicts) {
            judged.push(match is_down(&v) {
                true if self.refused_before(&e.id) => blamed(v),
                true => {
                    waiting.push(e.id.clone());
                    v.unsent_if_down().unwrap_or(v)
                }
                false => v,
            });
        }
        let judgement = self.partly_delivered(batch, judged, started, now);
        // (stamped before the probe's delivery, which is so a success since)
        let before = started
            .checked_sub(Duration::from_nanos(1))
            .unwrap_or(started);
        self.remember(waiting.iter().map(|id| (id.as_str(), true)), before);
        judgement
    }

    /// One key's events failed, answered as about them, soon after a success, and no other
    /// key has failed since: the key is poisoned, not the sink down.
    fn lone_key_failing(&self, said: &[(&crate::sinks::Event, &Verdict)], now: Instant) -> bool {
        let Some((first, _)) = said.first() else {
            return false;
        };
        let key = first.aggregate_id.as_str();
        // (a suspended sink's probe shows nothing: it failed for everything a moment ago)
        self.state == State::Healthy
            && one_key_about_it(said)
            && self.failing_keys.iter().all(|k| k == key)
            && self
                .last_success_at
                .is_some_and(|t| now.duration_since(t) < LONE_KEY_WINDOW)
    }

    /// Whether the sink refused the event before, as about itself, and delivered something
    /// since: refused again, the refusal is the event's, and final.
    fn refused_before(&self, id: &str) -> bool {
        let Some(success) = self.last_success_start else {
            return false;
        };
        (self.suspects.get(id)).is_some_and(|&(at, about)| about && success > at)
    }

    /// Keys that failed since the last success (lone_key_failing).
    fn note_failing<'a>(&mut self, keys: impl Iterator<Item = &'a str>) {
        for key in keys {
            if self.failing_keys.len() < 2 && !self.failing_keys.iter().any(|k| k == key) {
                self.failing_keys.push(key.to_owned()); // two are enough to say "not one key"
            }
        }
    }

    /// Whether the sink delivered since the batch's failed events last failed, or only a
    /// request started after `started` delivered. A failure to be counted (`about`: answered
    /// as about its event) is the event's only if every such failure of the batch is of an
    /// event the sink answered so before, with a success since: one failing for the first
    /// time may be the sink failing now, with the others caught in it, and an event only
    /// throttled before proves nothing. With nothing to count (all unsent), any event of the
    /// batch failed before with a success since keeps the sink from being suspended, as the
    /// waiting is the same.
    fn evidence(&self, started: Instant, failed: &[&str], about: &[&str]) -> Evidence {
        let Some(success) = self.last_success_start else {
            return Evidence::Nothing;
        };
        let since = |id: &&str, about_only: bool| {
            (self.suspects.get(*id)).is_some_and(|&(at, was)| success > at && (was || !about_only))
        };
        // failing since a suspension: a success before it shows nothing about now (a probe
        // that takes a head failed before an outage must not count it)
        let theirs = !matches!(self.state, State::Suspended(_))
            && match about.is_empty() {
                true => failed.iter().any(|id| since(id, false)),
                false => about.iter().all(|id| since(id, true)),
            };
        match (theirs, success > started) {
            (true, _) => Evidence::TheirOwn,
            (false, true) => Evidence::OthersDelivered,
            (false, false) => Evidence::Nothing,
        }
    }

    /// Remembers failed events (suspects), each with whether the sink answered as about it.
    fn remember<'a>(&mut self, failed: impl Iterator<Item = (&'a str, bool)>, now: Instant) {
        let failed: Vec<(&str, bool)> = failed.collect();
        if self.suspects.len() + failed.len() > SUSPECTS_MAX {
            self.suspects.clear(); // forgetting only delays a verdict: nothing is blamed wrongly
        }
        for (id, about) in failed {
            self.suspects.insert(id.to_owned(), (now, about));
        }
    }

    fn delivered(&mut self, started: Instant, now: Instant) {
        if self.last_success_start.is_none_or(|t| t < started) {
            self.last_success_start = Some(started);
        }
        self.last_success_at = Some(now);
        self.failing_keys.clear();
        if self.slowed_until.is_some_and(|t| t <= now) {
            self.slowed_until = None;
        }
        if matches!(self.state, State::Suspended(_)) {
            self.state = State::Healthy;
            self.probe = None;
            self.changed = true;
        }
    }

    fn give_back(
        &mut self,
        error: String,
        retry_after: Option<Duration>,
        was_probe: bool,
        now: Instant,
    ) -> Judgement {
        match &self.state {
            State::Suspended(_) if was_probe => self.probe_failed(&error, retry_after, now),
            State::Suspended(_) => {
                self.slow_down(retry_after, now);
            }
            State::Healthy => {
                let delay = retry_after.map_or(FIRST_PROBE, clamp_retry_after);
                let not_before = self.slow_down(retry_after, now);
                self.state = State::Suspended(Suspension {
                    reason: error.clone(),
                    since: SystemTime::now(),
                    next_probe: (now + delay).max(not_before),
                    delay,
                });
                self.suspensions += 1;
                self.changed = true;
            }
        }
        Judgement::GiveBack { error }
    }

    /// A probe failed: the next comes after twice the delay (at most MAX_PROBE_DELAY), or
    /// when the sink said.
    fn probe_failed(&mut self, error: &str, retry_after: Option<Duration>, now: Instant) {
        let not_before = self.slow_down(retry_after, now);
        if let State::Suspended(s) = &mut self.state {
            s.delay = retry_after.map_or((s.delay * 2).min(MAX_PROBE_DELAY), clamp_retry_after);
            s.next_probe = (now + s.delay).max(not_before);
            s.reason = error.to_owned();
        }
    }

    /// A batch settled with events unsent (throttled, or not sent for a reason of the sink's):
    /// no new claims for the sink's Retry-After, or SLOW_DOWN without one.
    fn throttled(&mut self, verdicts: &[Verdict], now: Instant) {
        if let Some(retry_after) = verdicts.iter().find_map(unsent_retry_after) {
            self.slow_down(Some(retry_after.unwrap_or(SLOW_DOWN)), now);
        }
    }

    /// A sink that says when to come back is not asked before then, suspended or not: returns
    /// the earliest time it may be asked again.
    fn slow_down(&mut self, retry_after: Option<Duration>, now: Instant) -> Instant {
        if let Some(retry_after) = retry_after {
            let until = now + clamp_retry_after(retry_after);
            self.slowed_until = Some(self.slowed_until.map_or(until, |t| t.max(until)));
        }
        self.slowed_until.unwrap_or(now)
    }

    /// Whether the state changed since the last call (then it is written and logged once).
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }
}

/// Whether the failures the sink reported were all of one key, and answered as about it (a
/// retry or a refusal: src/sinks/http.rs judge_failure says which answers are).
fn one_key_about_it(said: &[(&crate::sinks::Event, &Verdict)]) -> bool {
    said.first().is_some_and(|(first, _)| {
        said.iter()
            .all(|(e, v)| e.aggregate_id == first.aggregate_id && about_the_event(v))
    })
}

fn is_down(v: &Verdict) -> bool {
    matches!(v, Verdict::Down { .. })
}

/// A failure the sink answered as about the event (not "unsent", not decided before sending).
fn about_the_event(v: &Verdict) -> bool {
    matches!(v, Verdict::Retry { .. } | Verdict::Reject { .. })
}

/// The batch's failed events (a held-back one says nothing), each with whether the sink
/// answered as about it.
fn failures<'a>(
    batch: &'a Batch,
    verdicts: &'a [Verdict],
) -> impl Iterator<Item = (&'a str, bool)> {
    (batch.events.iter().zip(verdicts))
        .filter(|(_, v)| v.is_failure() && **v != Verdict::HeldBack)
        .map(|(e, v)| (e.id.as_str(), about_the_event(v)))
}

/// The ids of the batch's events whose failure the sink answered as about them.
fn answered_about<'a>(batch: &'a Batch, verdicts: &[Verdict]) -> Vec<&'a str> {
    (batch.events.iter().zip(verdicts))
        .filter(|(_, v)| about_the_event(v))
        .map(|(e, _)| e.id.as_str())
        .collect()
}

/// A batch that delivered some events: failures after the last of them in batch order (its
/// requests go out in that order), of two keys or more, are not counted (unsent): nothing
/// shows the sink took anything after them, and a receiver that starts refusing everything in
/// the middle of a batch (a deploy answering 400 or 500, a body limit lowered) looks just so.
/// A poisoned key fails alone; events of two keys failing in a row at the end of a batch are
/// tried again, as parked heads at the front of a later batch, where a success behind them
/// shows whose fault it is.
///
/// One key's failures there are counted, but a refusal is final only for an event refused
/// before, with a success since (`refused_before`): a deploy answering 400 to everything may
/// have landed just after the batch's last delivery.
fn unproven_tail_unsent(
    batch: &Batch,
    verdicts: Vec<Verdict>,
    refused_before: impl Fn(&str) -> bool,
) -> Vec<Verdict> {
    let Some(last) = verdicts.iter().rposition(|v| *v == Verdict::Delivered) else {
        return verdicts;
    };
    let tail = (batch.events.iter().zip(&verdicts)).skip(last + 1);
    let mut keys = tail
        .filter(|(_, v)| about_the_event(v))
        .map(|(e, _)| e.aggregate_id.as_str());
    let first = keys.next();
    let one_key = !keys.any(|k| Some(k) != first);
    let tail_verdict = |(i, (e, v)): (usize, (&crate::sinks::Event, Verdict))| match i > last {
        false => v,
        true if !one_key => v.uncounted(),
        true if refused_before(&e.id) => v,
        true => not_final(v), // one key: a poisoned key's look, counted
    };
    (batch.events.iter().zip(verdicts))
        .enumerate()
        .map(tail_verdict)
        .collect()
}

/// The verdicts with every failure turned into "not sent": nothing is counted.
fn unsent(verdicts: Vec<Verdict>, error: &str, retry_after: Option<Duration>) -> Vec<Verdict> {
    let not_sent = |v: Verdict| match v {
        Verdict::Retry { .. } | Verdict::Reject { .. } => Verdict::Unsent {
            error: error.to_owned(),
            retry_after,
        },
        other => other,
    };
    verdicts.into_iter().map(not_sent).collect()
}

/// A Down verdict's error (Verdict::Down).
fn down(v: &Verdict) -> Option<(String, Option<Duration>)> {
    match v {
        Verdict::Down {
            error, retry_after, ..
        } => Some((error.clone(), *retry_after)),
        _ => None,
    }
}

/// A refusal as a retry: counted, not final (Evidence::LoneKey).
fn not_final(v: Verdict) -> Verdict {
    match v {
        Verdict::Reject { error } => Verdict::Retry {
            error,
            retry_after: None,
        },
        other => other,
    }
}

/// A Down verdict on a sink shown healthy: a failed attempt of its event when the event may
/// have caused it; else (no connection, credentials refused: one bad instance of the
/// receiver's several) it waits, uncounted. Any other verdict as it is.
fn blamed(v: Verdict) -> Verdict {
    match v {
        Verdict::Down {
            error,
            retry_after,
            blameable: true,
        } => Verdict::Retry { error, retry_after },
        other => other.unsent_if_down().unwrap_or(other),
    }
}

fn clamp_retry_after(d: Duration) -> Duration {
    d.clamp(RETRY_AFTER_MIN, RETRY_AFTER_MAX)
}

fn unsent_retry_after(v: &Verdict) -> Option<Option<Duration>> {
    match v {
        Verdict::Unsent { retry_after, .. } => Some(*retry_after),
        _ => None,
    }
}

fn failure(v: &Verdict) -> Option<(String, Option<Duration>)> {
    match v {
        Verdict::Retry { error, retry_after }
        | Verdict::Unsent { error, retry_after }
        | Verdict::Down {
            error, retry_after, ..
        } => Some((error.clone(), *retry_after)),
        Verdict::Reject { error } | Verdict::Invalid { error } => Some((error.clone(), None)),
        Verdict::Delivered | Verdict::Skipped | Verdict::HeldBack => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sinks::test_event;

    fn batch(shard: i32, ids: &[&str]) -> Batch {
        Batch {
            sink: "s".into(),
            consumer_id: 1,
            shard,
            epoch: 1,
            deadline: Instant::now() + Duration::from_secs(60),
            events: ids
                .iter()
                .map(|id| crate::sinks::Event {
                    id: (*id).into(),
                    ..test_event(id)
                })
                .collect(),
        }
    }

    fn failed(n: usize) -> Outcome {
        let retry = Verdict::Retry {
            error: "HTTP 500".into(),
            retry_after: None,
        };
        Outcome::all(n, retry)
    }

    fn gave_back(j: &Judgement) -> bool {
        matches!(j, Judgement::GiveBack { .. })
    }

    #[test]
    fn every_request_failing_suspends_the_sink_and_blames_nothing() {
        let mut h = Health::default();
        let t0 = Instant::now();
        for round in 0..5 {
            let j = h.judge(&batch(round, &["a", "b"]), failed(2), t0);
            assert!(gave_back(&j), "round {round}: {j:?}");
        }
        assert!(matches!(h.state, State::Suspended(_)));
        assert_eq!(
            h.suspensions, 1,
            "one suspension, however many batches fail"
        );
        assert_eq!(
            h.claims(Instant::now(), 0),
            Claims::None,
            "no claim before the probe"
        );
    }

    /// Event `id` refused as about itself beside a delivery, then the sink delivers again.
    fn refused_then_a_success_since(h: &mut Health, id: &str) {
        let no = refused(1).into_verdicts(1).remove(0);
        let first = Outcome::Events(vec![Verdict::Delivered, no]);
        h.judge(&batch(1, &["x", id]), first, Instant::now());
        std::thread::sleep(Duration::from_millis(2));
        let ok = Outcome::all(1, Verdict::Delivered);
        h.judge(&batch(9, &["y"]), ok, Instant::now());
    }

    fn down_502() -> Verdict {
        Verdict::Down {
            error: "HTTP 502".into(),
            retry_after: None,
            blameable: true,
        }
    }

    /// A request that never reached the receiver (nothing it carried can have caused it).
    fn unreachable() -> Outcome {
        Outcome::SinkDown {
            error: "connection refused".into(),
            retry_after: None,
            blameable: false,
        }
    }

    fn unsent_502() -> Verdict {
        Verdict::Unsent {
            error: "HTTP 502".into(),
            retry_after: None,
        }
    }

    fn settled_uncounted(j: &Judgement) -> bool {
        matches!(j, Judgement::Settle(v) if v.iter().all(|v| matches!(v, Verdict::Unsent { .. })))
    }

    #[test]
    fn a_failure_beside_a_later_success_waits_uncounted_then_is_the_events_when_it_fails_again() {
        let mut h = Health::default();
        let poisoned_start = Instant::now();
        let later = poisoned_start + Duration::from_millis(1);
        let ok = || Outcome::all(1, Verdict::Delivered);
        assert!(matches!(
            h.judge(&batch(1, &["x"]), ok(), later),
            Judgement::Settle(_)
        ));
        let j = h.judge(&batch(2, &["p", "q"]), failed(2), poisoned_start);
        assert!(
            settled_uncounted(&j),
            "the sink takes other events, not suspended; nothing counted yet: {j:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
        h.judge(&batch(3, &["y"]), ok(), Instant::now());
        let j = h.judge(&batch(2, &["p", "q"]), failed(2), Instant::now());
        assert!(
            matches!(&j, Judgement::Settle(v) if matches!(v[0], Verdict::Retry { .. })),
            "failed so again after a success: theirs: {j:?}"
        );
    }

    #[test]
    fn a_receiver_refusing_everything_from_a_deploy_on_blames_no_batch_out_when_it_began() {
        // batch A goes out, then B; the receiver delivers B, then a deploy answers 400 to all,
        // A's requests too: B's success, though it started after A, says nothing of A's events
        let mut h = Health::default();
        let a_start = Instant::now();
        h.judge(
            &batch(2, &["y"]),
            Outcome::all(1, Verdict::Delivered),
            a_start + Duration::from_millis(1),
        );
        let j = h.judge(&batch(1, &["a", "b"]), refused(2), a_start);
        assert!(settled_uncounted(&j), "no dead letter: {j:?}");
        std::thread::sleep(Duration::from_millis(2));
        let j = h.judge(&batch(3, &["c", "d"]), refused(2), Instant::now());
        assert!(gave_back(&j), "then the sink is suspended: {j:?}");
    }

    #[test]
    fn a_first_refusal_before_a_request_that_found_the_sink_down_is_not_counted_on_its_evidence() {
        // b failed before, with a success since; in this batch a is refused (its first
        // failure), then b's request finds the sink down: b's past says nothing of a
        let mut h = Health::default();
        let no = || refused(1).into_verdicts(1).remove(0);
        refused_then_a_success_since(&mut h, "b");
        let started = Instant::now();
        let outcome = Outcome::Events(vec![no(), down_502(), unsent_502()]);
        let j = h.judge(&batch(3, &["a", "b", "c"]), outcome, started);
        assert!(gave_back(&j), "a is not dead-lettered: {j:?}");
    }

    #[test]
    fn a_success_that_started_before_the_failure_proves_nothing_until_the_event_fails_again() {
        let mut h = Health::default();
        let t0 = Instant::now();
        let ok = Outcome::all(1, Verdict::Delivered);
        let down = || Outcome::SinkDown {
            error: "HTTP 502".into(),
            retry_after: None,
            blameable: true,
        };
        h.judge(&batch(1, &["x"]), ok.clone(), t0);
        let j = h.judge(&batch(2, &["p"]), down(), t0 + Duration::from_millis(1));
        assert!(
            gave_back(&j),
            "the outage may have begun after x's request: {j:?}"
        );
        // the sink delivers other events after p's failure: p's next failure is p's
        h.judge(&batch(3, &["y"]), ok, Instant::now());
        let j = h.judge(&batch(2, &["p"]), down(), Instant::now());
        assert!(matches!(j, Judgement::Settle(_)), "{j:?}");
    }

    #[test]
    fn failures_of_two_keys_on_a_sink_found_down_are_no_evidence_against_them_later() {
        // a receiver flapping: down, up (a success), down again, e and f failing each time
        let mut h = Health::default();
        let down = || Outcome::SinkDown {
            error: "HTTP 502".into(),
            retry_after: None,
            blameable: true,
        };
        h.judge(
            &batch(1, &["x"]),
            Outcome::all(1, Verdict::Delivered),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_millis(2));
        assert!(gave_back(&h.judge(
            &batch(2, &["e", "f"]),
            down(),
            Instant::now()
        )));
        assert!(gave_back(&h.judge(
            &batch(3, &["e", "f"]),
            failed(2),
            Instant::now()
        )));
        std::thread::sleep(Duration::from_millis(2));
        h.judge(
            &batch(4, &["y"]),
            Outcome::all(1, Verdict::Delivered),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_millis(2));
        let j = h.judge(&batch(2, &["e", "f"]), down(), Instant::now());
        assert!(gave_back(&j), "not counted: {j:?}");
        let j = h.judge(&batch(3, &["e", "f"]), failed(2), Instant::now());
        assert!(gave_back(&j), "nor refused as about them: {j:?}");
    }

    #[test]
    fn a_sink_found_down_on_a_healthy_sink_blames_only_the_events_the_request_carried() {
        let mut h = Health::default();
        refused_then_a_success_since(&mut h, "a");
        let t0 = Instant::now();
        let not_carried = unsent_502();
        let outcome = Outcome::Events(vec![down_502(), not_carried.clone(), Verdict::Skipped]);
        let Judgement::Settle(v) = h.judge(&batch(2, &["a", "head", "away"]), outcome, t0) else {
            panic!("a sink shown healthy since: the carried event is blamed");
        };
        assert!(
            matches!(&v[0], Verdict::Retry { error, .. } if error == "HTTP 502"),
            "{v:?}"
        );
        assert_eq!(
            v[1..],
            [not_carried, Verdict::Skipped],
            "the rest is not counted"
        );
    }

    #[test]
    fn a_sink_failing_a_request_for_a_reason_of_its_own_never_blames_it_even_shown_healthy() {
        // one instance of the receiver's several refuses connections (or has an old secret)
        // while the others deliver: its requests' events wait, uncounted
        let mut h = Health::default();
        let t0 = Instant::now();
        let later = t0 + Duration::from_millis(1);
        h.judge(
            &batch(2, &["y"]),
            Outcome::all(1, Verdict::Delivered),
            later,
        );
        // a request that started after x's delivered: shown healthy
        let Judgement::Settle(v) = h.judge(&batch(1, &["x"]), unreachable(), t0) else {
            panic!("a sink shown healthy: settled, not given back");
        };
        assert!(
            matches!(&v[0], Verdict::Unsent { error, .. } if error == "connection refused"),
            "not counted: {v:?}"
        );
    }

    #[test]
    fn a_lone_key_failing_soon_after_a_success_is_the_keys_but_two_keys_are_not() {
        let mut h = Health::default();
        let t0 = Instant::now();
        h.judge(&batch(1, &["x"]), Outcome::all(1, Verdict::Delivered), t0);
        let later = t0 + Duration::from_millis(1);
        let j = h.judge(&batch(2, &["a", "b"]), failed(2), later);
        assert!(
            gave_back(&j),
            "two keys failing together: the sink, as far as we know"
        );
        let j = h.judge(&batch(3, &["a"]), failed(1), later);
        assert!(
            gave_back(&j),
            "another key failed since the last success: {j:?}"
        );
    }

    #[test]
    fn a_lone_keys_refusal_is_counted_not_final_until_refused_again_after_a_success() {
        let mut h = Health::default();
        let t0 = Instant::now();
        let retried = |j: &Judgement| matches!(j, Judgement::Settle(v) if matches!(v[0], Verdict::Retry { .. }));
        let rejected = |j: &Judgement| matches!(j, Judgement::Settle(v) if matches!(v[0], Verdict::Reject { .. }));
        h.judge(&batch(1, &["x"]), Outcome::all(1, Verdict::Delivered), t0);
        // a deploy answering 400 to everything, seen first by the only key sent: counted, so
        // its key waits out a backoff, but not dead-lettered, nor its next event after it
        let j = h.judge(&batch(2, &["a"]), refused(1), Instant::now());
        assert!(retried(&j), "{j:?}");
        let j = h.judge(&batch(2, &["a"]), refused(1), Instant::now());
        assert!(retried(&j), "refused again, nothing delivered since: {j:?}");
        // the sink delivers other events (a request that began after): refused again, it is
        // the event's
        std::thread::sleep(Duration::from_millis(2));
        let y = Instant::now();
        h.judge(&batch(3, &["y"]), Outcome::all(1, Verdict::Delivered), y);
        let j = h.judge(&batch(2, &["a"]), refused(1), Instant::now());
        assert!(rejected(&j), "{j:?}");
    }

    #[test]
    fn a_probe_of_a_suspended_sink_is_no_lone_key() {
        let mut h = Health::default();
        let t0 = Instant::now();
        h.judge(&batch(1, &["x"]), Outcome::all(1, Verdict::Delivered), t0);
        // the only key found the sink down (connection refused): suspended
        let j = h.judge(
            &batch(2, &["a"]),
            unreachable(),
            t0 + Duration::from_millis(1),
        );
        assert!(gave_back(&j), "{j:?}");
        let probe = batch(3, &["a"]);
        h.probe_sent(&probe, false);
        let j = h.judge(&probe, refused(1), t0 + Duration::from_millis(2));
        assert!(
            gave_back(&j),
            "a probe failing as the batches before it: {j:?}"
        );
    }

    #[test]
    fn a_second_key_failing_alone_after_a_key_was_blamed_is_not_blamed() {
        let mut h = Health::default();
        let t0 = Instant::now();
        h.judge(&batch(1, &["x"]), Outcome::all(1, Verdict::Delivered), t0);
        let later = t0 + Duration::from_millis(1);
        let j = h.judge(&batch(2, &["a"]), failed(1), later);
        assert!(matches!(j, Judgement::Settle(_)), "a lone key: {j:?}");
        let j = h.judge(&batch(3, &["a"]), failed(1), later);
        assert!(
            matches!(j, Judgement::Settle(_)),
            "the same key again: {j:?}"
        );
        let j = h.judge(&batch(4, &["b"]), failed(1), later);
        assert!(
            gave_back(&j),
            "a second key failing alone: every request fails, the sink's: {j:?}"
        );
    }

    #[test]
    fn a_probe_that_delivers_resumes_the_sink_and_one_that_fails_backs_off() {
        let mut h = Health::default();
        h.judge(&batch(1, &["a"]), failed(1), Instant::now());
        let State::Suspended(first) = h.state.clone() else {
            panic!("not suspended")
        };
        let probe = batch(4, &["b"]);
        h.probe_sent(&probe, false);
        h.judge(&probe, failed(1), Instant::now());
        let State::Suspended(second) = h.state.clone() else {
            panic!("not suspended")
        };
        assert_eq!(
            second.delay,
            first.delay * 2,
            "a failed probe doubles the delay"
        );
        let probe = batch(5, &["c"]);
        h.probe_sent(&probe, false);
        let j = h.judge(&probe, Outcome::all(1, Verdict::Delivered), Instant::now());
        assert!(matches!(j, Judgement::Settle(_)));
        assert_eq!(h.state, State::Healthy);
        assert_eq!(h.claims(Instant::now(), 0), Claims::Full);
    }

    #[test]
    fn a_probe_of_the_only_key_with_work_lets_it_wait_uncounted() {
        let mut h = Health::default();
        h.judge(&batch(1, &["p"]), failed(1), Instant::now());
        let probe = batch(1, &["p"]);
        h.probe_sent(&probe, false);
        let j = h.judge(&probe, failed(1), Instant::now());
        assert!(
            gave_back(&j),
            "other work could tell the sink from the key: {j:?}"
        );
        let probe = batch(1, &["p"]);
        h.probe_sent(&probe, true);
        let j = h.judge(&probe, failed(1), Instant::now());
        let Judgement::Settle(verdicts) = j else {
            panic!("given back: the next probe would find the same key again: {j:?}")
        };
        assert!(
            matches!(verdicts[..], [Verdict::Unsent { .. }]),
            "nothing counted: {verdicts:?}"
        );
        assert!(matches!(h.state, State::Suspended(_)), "still suspended");
        // two keys failing in a probe: the sink, as far as we know
        let probe = batch(2, &["a", "b"]);
        h.probe_sent(&probe, false);
        assert!(gave_back(&h.judge(&probe, failed(2), Instant::now())));
    }

    #[test]
    fn unsent_is_never_blamed_and_a_partial_throttle_slows_the_sink() {
        let mut h = Health::default();
        let throttled = Verdict::Unsent {
            error: "HTTP 429".into(),
            retry_after: Some(Duration::from_secs(2)),
        };
        let outcome = Outcome::Events(vec![Verdict::Delivered, throttled]);
        let j = h.judge(&batch(1, &["a", "b"]), outcome, Instant::now());
        assert!(
            matches!(j, Judgement::Settle(_)),
            "the delivered part is acked"
        );
        assert_eq!(
            h.claims(Instant::now(), 0),
            Claims::None,
            "slowed by Retry-After"
        );
    }

    fn refused(n: usize) -> Outcome {
        Outcome::all(
            n,
            Verdict::Reject {
                error: "HTTP 400".into(),
            },
        )
    }

    fn keyed_batch(shard: i32, keys: &[&str]) -> Batch {
        let mut b = batch(shard, &[]);
        b.events = (keys.iter().enumerate())
            .map(|(i, k)| crate::sinks::Event {
                id: format!("{k}-{i}"),
                ..test_event(k)
            })
            .collect();
        b
    }

    #[test]
    fn an_event_that_found_the_sink_unreachable_is_no_suspect_later() {
        let mut h = Health::default();
        let t0 = Instant::now();
        let j = h.judge(&batch(1, &["e"]), unreachable(), t0);
        assert!(gave_back(&j), "{j:?}");
        let back = t0 + Duration::from_millis(1);
        h.judge(&batch(2, &["y"]), Outcome::all(1, Verdict::Delivered), back);
        // its first refusal since is its first as about itself: not final
        let j = h.judge(
            &batch(1, &["e"]),
            refused(1),
            back + Duration::from_millis(1),
        );
        assert!(
            matches!(&j, Judgement::Settle(v) if matches!(v[0], Verdict::Retry { .. })),
            "{j:?}"
        );
    }

    #[test]
    fn a_probe_that_delivers_past_an_event_that_found_the_sink_down_resumes_it() {
        let mut h = Health::default();
        let t0 = Instant::now();
        let not_sent = Verdict::Unsent {
            error: "not sent".into(),
            retry_after: None,
        };
        let j = h.judge(
            &batch(1, &["p", "a"]),
            Outcome::Events(vec![down_502(), not_sent]),
            t0,
        );
        assert!(gave_back(&j), "{j:?}");
        let probe = batch(1, &["p", "a"]);
        h.probe_sent(&probe, false);
        let at = t0 + Duration::from_millis(1);
        let j = h.judge(
            &probe,
            Outcome::Events(vec![down_502(), Verdict::Delivered]),
            at,
        );
        let Judgement::Settle(v) = j else {
            panic!("{j:?}")
        };
        assert!(matches!(&v[0], Verdict::Unsent { .. }), "uncounted: {v:?}");
        assert_eq!(h.state, State::Healthy);
        // p fails so again: the probe's delivery was a success since, so it is its own
        let j = h.judge(
            &batch(1, &["p"]),
            Outcome::Events(vec![down_502()]),
            Instant::now(),
        );
        assert!(
            matches!(&j, Judgement::Settle(v) if matches!(v[0], Verdict::Retry { .. })),
            "{j:?}"
        );
    }

    #[test]
    fn a_batch_all_throttled_while_another_delivered_still_slows_the_sink() {
        let mut h = Health::default();
        let t0 = Instant::now();
        let later = t0 + Duration::from_millis(1);
        h.judge(
            &batch(2, &["y"]),
            Outcome::all(1, Verdict::Delivered),
            later,
        );
        let asked = Verdict::Unsent {
            error: "HTTP 429".into(),
            retry_after: Some(Duration::from_secs(2)),
        };
        let j = h.judge(&batch(1, &["a", "b"]), Outcome::all(2, asked), t0);
        assert!(matches!(j, Judgement::Settle(_)), "{j:?}");
        assert_eq!(
            h.claims(Instant::now(), 0),
            Claims::None,
            "asked to wait 2 s"
        );
        let after = Instant::now() + Duration::from_millis(2100);
        assert_eq!(h.claims(after, 0), Claims::Full);
    }

    #[test]
    fn an_event_throttled_before_proves_nothing_when_the_sink_fails_later() {
        let mut h = Health::default();
        let throttled = Verdict::Unsent {
            error: "HTTP 429".into(),
            retry_after: None,
        };
        let first = Outcome::Events(vec![Verdict::Delivered, throttled]);
        h.judge(&batch(1, &["x", "e"]), first, Instant::now());
        std::thread::sleep(Duration::from_millis(2));
        h.judge(
            &batch(2, &["y"]),
            Outcome::all(1, Verdict::Delivered),
            Instant::now(),
        );
        // the receiver falls over: e comes again beside f, and both are refused
        let j = h.judge(&batch(3, &["e", "f"]), refused(2), Instant::now());
        assert!(gave_back(&j), "neither is blamed: {j:?}");
        // nor does an event refused once make its batch-mates' first failure theirs
        let mut h = Health::default();
        h.judge(
            &batch(1, &["x", "p"]),
            Outcome::Events(vec![
                Verdict::Delivered,
                refused(1).into_verdicts(1).remove(0),
            ]),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_millis(2));
        h.judge(
            &batch(2, &["y"]),
            Outcome::all(1, Verdict::Delivered),
            Instant::now(),
        );
        let j = h.judge(&batch(3, &["p", "f"]), refused(2), Instant::now());
        assert!(gave_back(&j), "f fails for the first time: {j:?}");
        std::thread::sleep(Duration::from_millis(2));
        h.judge(
            &batch(4, &["z"]),
            Outcome::all(1, Verdict::Delivered),
            Instant::now(),
        );
        let j = h.judge(&batch(5, &["p"]), refused(1), Instant::now());
        assert!(
            matches!(j, Judgement::Settle(_)),
            "p alone again, after a success since: p's: {j:?}"
        );
    }

    #[test]
    fn keys_refused_after_a_batchs_last_delivery_are_not_counted_one_key_is() {
        let mut h = Health::default();
        let kinds = |j: Judgement| match j {
            Judgement::Settle(v) => v
                .iter()
                .map(|v| match v {
                    Verdict::Delivered => "ok",
                    Verdict::Reject { .. } => "reject",
                    Verdict::Retry { .. } => "retry",
                    Verdict::Unsent { .. } => "unsent",
                    Verdict::HeldBack => "held",
                    _ => "other",
                })
                .collect::<Vec<_>>(),
            j => panic!("{j:?}"),
        };
        let no = || refused(1).into_verdicts(1).remove(0);
        let ok = || Verdict::Delivered;
        // a deploy answering 400 to everything from the third request on
        let b = keyed_batch(1, &["a", "b", "c", "d", "e"]);
        let v = vec![ok(), ok(), no(), no(), no()];
        assert_eq!(
            kinds(h.judge(&b, Outcome::Events(v), Instant::now())),
            ["ok", "ok", "unsent", "unsent", "unsent"]
        );
        // a poisoned key at the end, its later event held back: the key's, counted, but not
        // final (a deploy may have landed just after the last delivery)
        let b = keyed_batch(2, &["a", "b", "c", "c"]);
        let v = vec![ok(), ok(), no(), Verdict::HeldBack];
        assert_eq!(
            kinds(h.judge(&b, Outcome::Events(v), Instant::now())),
            ["ok", "ok", "retry", "held"]
        );
        // refusals with a success behind them are the events'
        std::thread::sleep(Duration::from_millis(2));
        let b = keyed_batch(3, &["a", "b", "x", "d"]);
        let v = vec![ok(), no(), no(), ok()];
        assert_eq!(
            kinds(h.judge(&b, Outcome::Events(v), Instant::now())),
            ["ok", "reject", "reject", "ok"]
        );
        // refused again at the end of a batch, with a success since: final
        let b = keyed_batch(2, &["a", "b", "c"]); // (the same event: ids are key and place)
        let v = vec![ok(), ok(), no()];
        assert_eq!(
            kinds(h.judge(&b, Outcome::Events(v), Instant::now())),
            ["ok", "ok", "reject"]
        );
    }

    #[test]
    fn an_event_failed_before_an_outage_is_not_counted_by_a_probe_during_it() {
        let mut h = Health::default();
        let no = || refused(1).into_verdicts(1).remove(0);
        // e fails as about itself beside a success, and the sink delivers again since
        let first = Outcome::Events(vec![Verdict::Delivered, no()]);
        h.judge(&batch(1, &["x", "e"]), first, Instant::now());
        std::thread::sleep(Duration::from_millis(2));
        h.judge(
            &batch(2, &["y"]),
            Outcome::all(1, Verdict::Delivered),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_millis(2));
        // then the receiver goes down: suspended
        assert!(gave_back(&h.judge(
            &batch(3, &["f", "g"]),
            failed(2),
            Instant::now()
        )));
        // a probe takes e, due again, and it fails with the rest
        let probe = batch(4, &["e"]);
        h.probe_sent(&probe, false);
        let j = h.judge(&probe, refused(1), Instant::now());
        assert!(gave_back(&j), "not counted while the sink is down: {j:?}");
    }
}
