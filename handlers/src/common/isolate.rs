//! One entry's backend work, kept that entry's alone: every call runs under its own time
//! share, a panic in it is caught, and no call starts once the run's budget is spent, so
//! one caller's entry can neither fail a run nor hold the others past their budget.
//!
//! Whether an error is the entry's or the backend's is the capability's to say (a refused
//! statement is the entry's; a lost connection is the backend's), with one rule for the
//! ambiguous case that [`Blame`] applies: the backend is down only if nothing of the run
//! reached it and a probe of it fails too. Otherwise the failures are the entries' own.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use futures_util::FutureExt;

/// How one run spends its time on entries.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// No entry's work starts after this.
    pub deadline: Instant,
    /// The longest one entry's work may take; past it, that entry alone is given up for
    /// this run. Keep `per_entry` well under the run's budget, so that a few slow entries
    /// cannot take the time of every other.
    pub per_entry: Duration,
    /// Entries worked on at once.
    pub in_flight: usize,
}

impl Budget {
    /// A budget of `total` from now, `per_entry` each, `in_flight` at once.
    pub fn new(total: Duration, per_entry: Duration, in_flight: usize) -> Budget {
        Budget {
            deadline: Instant::now() + total,
            per_entry,
            in_flight: in_flight.max(1),
        }
    }
}

/// What became of one entry's work.
#[derive(Debug)]
pub enum Attempt<R> {
    /// It ran to its end (with the capability's own result, success or not).
    Done(R),
    /// The run's budget was spent before it started: it waits for a later run.
    NotStarted,
    /// It took longer than its share; given up for this run.
    TimedOut(Duration),
    /// It panicked (a bug that input of this entry hit): this entry alone is failed.
    Panicked(String),
}

impl<R> Attempt<R> {
    /// The one-line reason an entry whose work did not finish gets.
    pub fn reason(&self, what: &str) -> Option<String> {
        match self {
            Attempt::Done(_) => None,
            Attempt::NotStarted => Some(format!("waiting for its turn at {what}")),
            Attempt::TimedOut(t) => Some(format!(
                "{what} took longer than the {} s one entry may take; tried again in a later run",
                t.as_secs()
            )),
            Attempt::Panicked(why) => Some(format!(
                "the handler failed on this entry ({why}); the other entries are served"
            )),
        }
    }
}

/// Runs `work` for every job, `budget.in_flight` at a time, each under its own time
/// share and with its panics caught. Results come back in completion order.
pub async fn each<J, R, F, Fut>(
    jobs: Vec<(String, J)>,
    budget: Budget,
    work: F,
) -> Vec<(String, Attempt<R>)>
where
    F: Fn(J) -> Fut,
    Fut: Future<Output = R>,
{
    let work = &work;
    stream::iter(jobs)
        .map(|(key, job)| async move {
            if Instant::now() >= budget.deadline {
                return (key, Attempt::NotStarted);
            }
            let guarded = AssertUnwindSafe(work(job)).catch_unwind();
            let attempt = match tokio::time::timeout(budget.per_entry, guarded).await {
                Ok(Ok(result)) => Attempt::Done(result),
                Ok(Err(panic)) => Attempt::Panicked(panic_message(panic.as_ref())),
                Err(_) => Attempt::TimedOut(budget.per_entry),
            };
            (key, attempt)
        })
        .buffer_unordered(budget.in_flight)
        .collect()
        .await
}

/// The message of a caught panic, one line and bounded (it reaches the entry's consumer).
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_owned());
    crate::common::entries::one_line(&text)
        .chars()
        .take(120)
        .collect()
}

/// Counts the calls of a run that reached the backend and those that failed in a way
/// that may be the backend's, to decide whose the failures are.
#[derive(Debug, Default)]
pub struct Blame {
    /// Calls the backend answered (an acceptance or a refusal of the entry).
    pub answered: usize,
    /// Calls that failed without an answer that says the entry is at fault.
    pub failed: usize,
}

impl Blame {
    /// Whether the run must fail because the backend is down: some call failed, none was
    /// answered, and `probe` (a call any healthy backend answers, carrying nothing of any
    /// entry) fails too. The probe runs only in that case.
    pub async fn backend_down<E, P>(&self, probe: impl FnOnce() -> P) -> Option<E>
    where
        P: Future<Output = Result<(), E>>,
    {
        if self.failed == 0 || self.answered > 0 {
            return None;
        }
        probe().await.err()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::{parse_input, Output};

    /// A capability's run in miniature: a backend call per entry, where `bad` panics,
    /// `slow` hangs and `broken` errors; every other entry is answered in the same run.
    async fn miniature_run(input: &[u8]) -> Output {
        let entries = parse_input(input).unwrap();
        let jobs: Vec<(String, String)> = entries
            .iter()
            .map(|e| (e.key.clone(), e.need.id().to_owned()))
            .collect();
        let budget = Budget::new(Duration::from_secs(5), Duration::from_millis(300), 4);
        let results = each(jobs, budget, |id: String| async move {
            match id.as_str() {
                "bad" => panic!("index out of bounds: the len is 0 but the index is 3"),
                "slow" => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok("never".to_owned())
                }
                "broken" => Err("the backend refused this entry's value".to_owned()),
                other => Ok(format!("made {other}")),
            }
        })
        .await;
        let mut out = Output::default();
        for (key, attempt) in results {
            let entry = entries.iter().find(|e| e.key == key).unwrap();
            match attempt {
                Attempt::Done(Ok(made)) => out.respond(entry, serde_json::json!(made)),
                Attempt::Done(Err(why)) => out.refuse(entry, why),
                other => out.pending(entry, other.reason("the backend").unwrap()),
            }
        }
        out
    }

    #[tokio::test]
    async fn a_panic_an_error_or_a_hang_in_one_entry_leaves_the_others_answered() {
        let input =
            br#"{"a:t/one":{"request":{}},"a:t/bad":{"request":{}},"b:t/slow":{"request":{}},
                         "b:t/broken":{"request":{}},"c:t/two":{"request":{}}}"#;
        let started = Instant::now();
        let out = miniature_run(input).await.into_json();
        // The hanging entry cost its own share, not the run's budget.
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(out["a:t/one"], "made one");
        assert_eq!(out["c:t/two"], "made two");
        let bad = out["a:t/bad"]["$fort_pending"].as_str().unwrap();
        assert!(bad.contains("index out of bounds"), "{bad}");
        let slow = out["b:t/slow"]["$fort_pending"].as_str().unwrap();
        assert!(slow.contains("took longer than"), "{slow}");
        assert_eq!(
            out["b:t/broken"]["$fort_refused"],
            "the backend refused this entry's value"
        );
    }

    #[tokio::test]
    async fn nothing_starts_after_the_deadline() {
        let budget = Budget {
            deadline: Instant::now(),
            per_entry: Duration::from_secs(1),
            in_flight: 2,
        };
        let results = each(vec![("k".to_owned(), ())], budget, |_| async { 1 }).await;
        assert!(matches!(results[0].1, Attempt::NotStarted));
    }

    #[tokio::test]
    async fn the_backend_is_down_only_when_nothing_reached_it_and_the_probe_fails() {
        let down = |answered, failed| Blame { answered, failed };
        let probe_fails = || async { Err::<(), _>("connection refused") };
        let probe_passes = || async { Ok::<(), &str>(()) };
        assert_eq!(
            down(0, 2).backend_down(probe_fails).await,
            Some("connection refused")
        );
        assert_eq!(down(0, 2).backend_down(probe_passes).await, None);
        assert_eq!(down(1, 2).backend_down(probe_fails).await, None);
        assert_eq!(down(0, 0).backend_down(probe_fails).await, None);
    }
}
