//! Whether a Kafka topic takes records: the evidence that says if a record a topic refused on
//! its own (too large, not valid) is the record's fault. A sink's health is judged across its
//! topics (src/worker/health.rs), and a topic whose `max.message.bytes` was lowered by mistake
//! refuses every record of its own while the sink's other topics deliver: each refusal would
//! look like its record's. So a record refused alone is blamed only once its topic has taken
//! another record of ours since it was first refused (or during the batch that refused it);
//! until then it goes back unsent and waits, in order, uncounted. Used by the native sink
//! (src/sinks/kafka.rs) and the Kafka REST sinks (src/sinks/kafka_rest.rs), each sink with its
//! own. Kept in memory: lost at a restart, it only makes a refused record wait longer.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// Records refused alone remembered at most (forgetting one only delays its verdict).
const REFUSED_KEPT: usize = 10_000;

#[derive(Default)]
pub struct TopicEvidence {
    /// Per topic, when it last took a record of ours.
    taken_at: HashMap<String, Instant>,
    /// Per record refused alone (event id), when it first was.
    refused_at: HashMap<String, Instant>,
    /// Records blamed: their topic took another record since they were first refused, so each
    /// later refusal is theirs too (a Kafka REST sink counts them up to max_attempts).
    blamed: HashSet<String>,
}

impl TopicEvidence {
    /// Nothing to judge, now or later: the clean path does no more.
    pub fn waiting_on_nothing(&self) -> bool {
        self.refused_at.is_empty()
    }

    /// The topic took a record of ours at `at`.
    pub fn took(&mut self, topic: &str, at: Instant) {
        match self.taken_at.get_mut(topic) {
            Some(t) => *t = at.max(*t),
            None => {
                self.taken_at.insert(topic.to_owned(), at);
            }
        }
    }

    /// Record `id`, refused alone by `topic` in a batch begun at `started`: whether it is to
    /// blame (its topic took a record since it was first refused, or during that batch; once
    /// so, for good). One not blamed is remembered from its first refusal on.
    pub fn blames(&mut self, topic: &str, id: &str, started: Instant) -> bool {
        if self.blamed.contains(id) {
            return true;
        }
        if self.refused_at.len() >= REFUSED_KEPT && !self.refused_at.contains_key(id) {
            self.refused_at.clear();
        }
        let since = *self.refused_at.entry(id.to_owned()).or_insert(started);
        let taken = self.taken_at.get(topic).is_some_and(|&t| t >= since);
        if taken {
            self.refused_at.remove(id);
            if self.blamed.len() >= REFUSED_KEPT {
                self.blamed.clear();
            }
            self.blamed.insert(id.to_owned());
        }
        taken
    }
}

/// The verdict of a record refused alone that is not yet to blame: it goes back unsent, its
/// key waiting in order, uncounted, with the refusal and why it is not counted.
pub fn not_yet_blamed(error: &str, topic: &str) -> super::Verdict {
    super::Verdict::Unsent {
        error: format!("{error} (no record to {topic} went through since)"),
        retry_after: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_record_refused_alone_is_blamed_once_its_topic_takes_another() {
        let mut evidence = TopicEvidence::default();
        let t0 = Instant::now();
        evidence.took("small", t0);
        let t1 = t0 + Duration::from_millis(10);
        assert!(!evidence.blames("small", "e1", t1), "nothing taken since");
        assert!(!evidence.waiting_on_nothing());
        evidence.took("other", t1 + Duration::from_millis(5));
        assert!(
            !evidence.blames("small", "e1", t1 + Duration::from_millis(20)),
            "another topic says nothing"
        );
        evidence.took("small", t1 + Duration::from_millis(30));
        assert!(
            evidence.blames("small", "e1", t1 + Duration::from_millis(40)),
            "since its first refusal"
        );
        assert!(
            evidence.waiting_on_nothing(),
            "blamed: nothing left to wait on"
        );
        assert!(
            evidence.blames("small", "e1", t1 + Duration::from_secs(9)),
            "and for good"
        );
        // taken during the batch that refused it
        evidence.took("small", t1 + Duration::from_millis(60));
        assert!(evidence.blames("small", "e2", t1 + Duration::from_millis(50)));
    }
}
