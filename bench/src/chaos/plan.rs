//! The faults of a run, drawn up front from the seed: the same seed, fleet and flags
//! give the same plan (when each fault starts, what it hits, how long it holds), which
//! the run then carries out. Faults never overlap on a host, and at most `max_active`
//! hold at once, so the fleet is mostly up and every fault's effect can be told apart.

use std::collections::BTreeMap;
use std::time::Duration;

use super::layout::{Layout, PG, SSH, TOK};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Kill,
    Hang,
    Partition,
    OneWay,
    Slow,
    DiskFull,
    Clock,
    HandlerKill,
    KeyRotation,
    Reload,
    Rollback,
}

impl Kind {
    pub const ALL: [Kind; 11] = [
        Kind::Kill,
        Kind::Hang,
        Kind::Partition,
        Kind::OneWay,
        Kind::Slow,
        Kind::DiskFull,
        Kind::Clock,
        Kind::HandlerKill,
        Kind::KeyRotation,
        Kind::Reload,
        Kind::Rollback,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Kill => "kill",
            Kind::Hang => "hang",
            Kind::Partition => "partition",
            Kind::OneWay => "one-way",
            Kind::Slow => "slow-link",
            Kind::DiskFull => "disk-full",
            Kind::Clock => "clock",
            Kind::HandlerKill => "handler-kill",
            Kind::KeyRotation => "key-rotation",
            Kind::Reload => "reload",
            Kind::Rollback => "rollback",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Faults per minute unless `--rate` says otherwise.
    pub fn default_rate(self) -> f64 {
        match self {
            Kind::Kill => 2.0,
            Kind::Hang => 1.0,
            Kind::Partition => 1.0,
            Kind::OneWay => 0.5,
            Kind::Slow => 0.5,
            Kind::DiskFull => 0.5,
            Kind::Clock => 0.3,
            Kind::HandlerKill => 0.6,
            Kind::KeyRotation => 0.3,
            Kind::Reload => 1.0,
            Kind::Rollback => 0.3,
        }
    }

    /// How long it holds, in seconds (least, most).
    fn hold(self) -> (u64, u64) {
        match self {
            // The time the host is down before it is started again: mostly a moment,
            // sometimes long enough for its needs to move (drawn towards the short end).
            Kind::Kill => (0, 120),
            Kind::HandlerKill => (0, 10),
            Kind::Hang => (5, 60),
            Kind::Partition | Kind::OneWay => (15, 90),
            Kind::Slow => (20, 60),
            Kind::DiskFull => (10, 40),
            Kind::Clock => (40, 90),
            Kind::KeyRotation | Kind::Reload => (0, 0),
            Kind::Rollback => (30, 90),
        }
    }

    /// Between two hosts (the first a consumer, the second one of its providers).
    pub fn is_link(self) -> bool {
        matches!(self, Kind::Partition | Kind::OneWay | Kind::Slow)
    }
}

#[derive(Debug, Clone)]
pub struct Event {
    /// From the start of the fault phase.
    pub at: Duration,
    pub kind: Kind,
    pub hosts: Vec<String>,
    pub hold: Duration,
    /// A draw of its own for what the fault chooses (a clock's offset, a crash point,
    /// a partition's direction, what a reload changes).
    pub param: u64,
}

/// An operator's call meanwhile: `status` of a host, or `trigger` of a provider's
/// capability (for one entry, perhaps forced: a new credential for it).
#[derive(Debug, Clone)]
pub struct OpCall {
    pub at: Duration,
    pub host: String,
    pub trigger: Option<(String, Option<String>, bool)>,
}

pub struct Plan {
    pub events: Vec<Event>,
    pub ops: Vec<OpCall>,
    /// Faults drawn that found no free host or were past `max_active`, per kind.
    pub dropped: BTreeMap<&'static str, u64>,
}

/// A tiny seeded generator (SplitMix64): the same seed, the same plan.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The hosts a fault of `kind` may hit: one host, or a (consumer, provider) pair.
fn targets(kind: Kind, layout: &Layout) -> Vec<Vec<String>> {
    match kind {
        Kind::Kill | Kind::Hang | Kind::DiskFull | Kind::Clock => {
            // Providers as often as consumers, though there are fewer of them: a
            // provider's fault is felt by many.
            let providers = layout.providers();
            let weight = (layout.consumers.len() / providers.len().max(1)).max(1);
            let mut hosts: Vec<Vec<String>> = Vec::new();
            for _ in 0..weight {
                hosts.extend(providers.iter().map(|p| vec![p.clone()]));
            }
            hosts.extend(layout.consumers.iter().map(|c| vec![c.name.clone()]));
            hosts
        }
        Kind::Partition | Kind::OneWay | Kind::Slow => {
            let mut pairs = Vec::new();
            for c in &layout.consumers {
                let mut providers: Vec<String> =
                    layout.needs_of(&c.name).into_values().flatten().collect();
                providers.sort();
                providers.dedup();
                pairs.extend(providers.into_iter().map(|p| vec![c.name.clone(), p]));
            }
            pairs
        }
        Kind::HandlerKill | Kind::KeyRotation => {
            layout.providers().into_iter().map(|h| vec![h]).collect()
        }
        Kind::Reload => layout
            .consumers
            .iter()
            .map(|c| vec![c.name.clone()])
            .collect(),
        Kind::Rollback => layout
            .consumers
            .iter()
            .filter(|c| c.rollback)
            .map(|c| vec![c.name.clone()])
            .collect(),
    }
}

/// Draws the plan for a fault phase of `duration`.
pub fn make(
    seed: u64,
    layout: &Layout,
    rates: &BTreeMap<Kind, f64>,
    duration: Duration,
    max_active: usize,
) -> Plan {
    let mut rng = Rng::new(seed);
    let minutes = duration.as_secs_f64() / 60.0;
    let span = duration.as_millis() as u64;
    let mut drawn: Vec<(u64, Kind)> = Vec::new();
    for (kind, rate) in rates {
        let expected = rate * minutes;
        let mut n = expected.floor() as u64;
        if rng.unit() < expected.fract() {
            n += 1;
        }
        for _ in 0..n {
            drawn.push((rng.below(span), *kind));
        }
    }
    drawn.sort();
    // Every host's planned faults, as (from, until) in ms, with room to recover after.
    let mut busy: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
    let mut active: Vec<(u64, u64)> = Vec::new();
    let mut events = Vec::new();
    let mut dropped: BTreeMap<&'static str, u64> = BTreeMap::new();
    for (at, kind) in drawn {
        let (lo, hi) = kind.hold();
        let u = rng.unit();
        let u = if kind == Kind::Kill { u * u } else { u };
        let hold = (lo as f64 + (hi - lo) as f64 * u).round() as u64 * 1000;
        let hold = hold.min(span.saturating_sub(at));
        // A restart, a rotation or a reload takes time of its own; then some quiet.
        let until = at + hold + 15_000;
        let free = |h: &String| {
            busy.get(h)
                .is_none_or(|spans| spans.iter().all(|(s, e)| until <= *s || at >= *e))
        };
        let param = rng.next();
        if active.iter().filter(|(s, e)| *s <= at && at < *e).count() >= max_active {
            *dropped.entry(kind.name()).or_default() += 1;
            continue;
        }
        let choices: Vec<Vec<String>> = targets(kind, layout)
            .into_iter()
            .filter(|hosts| hosts.iter().all(free))
            .collect();
        if choices.is_empty() {
            *dropped.entry(kind.name()).or_default() += 1;
            continue;
        }
        let hosts = choices[rng.below(choices.len() as u64) as usize].clone();
        for h in &hosts {
            busy.entry(h.clone()).or_default().push((at, until));
        }
        active.push((at, until));
        events.push(Event {
            at: Duration::from_millis(at),
            kind,
            hosts,
            hold: Duration::from_millis(hold),
            param,
        });
    }
    let ops = operator_calls(&mut rng, layout, span);
    Plan {
        events,
        ops,
        dropped,
    }
}

/// A `status` call to some host every 3 s, and a `trigger` of some provider every 15 s
/// (every third one forced for one entry: an operator rotating one credential).
fn operator_calls(rng: &mut Rng, layout: &Layout, span: u64) -> Vec<OpCall> {
    let hosts = layout.hosts();
    let mut ops = Vec::new();
    let mut at = 0;
    let mut n = 0u64;
    while at < span {
        let host = hosts[rng.below(hosts.len() as u64) as usize].clone();
        ops.push(OpCall {
            at: Duration::from_millis(at),
            host,
            trigger: None,
        });
        n += 1;
        if n.is_multiple_of(5) {
            let force = n.is_multiple_of(15);
            let c = &layout.consumers[rng.below(layout.consumers.len() as u64) as usize];
            let (host, cap, need) = match rng.below(3) {
                0 => (layout.vault.clone(), TOK.to_owned(), super::layout::API),
                1 if !c.pg_from.is_empty() => {
                    (c.pg_from[0].clone(), PG.to_owned(), super::layout::DB)
                }
                _ => (
                    c.ssh_from[0].clone(),
                    SSH.to_owned(),
                    super::layout::HOST_CERT,
                ),
            };
            let entry = force.then(|| format!("{}:{need}", c.name));
            ops.push(OpCall {
                at: Duration::from_millis(at),
                host,
                trigger: Some((cap, entry, force)),
            });
        }
        at += 3000;
    }
    ops
}

/// A short digest of the plan, printed with the seed: a replay shows the same one.
pub fn fingerprint(plan: &Plan) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for e in &plan.events {
        let text = format!("{:?}{:?}{:?}{:?}{}", e.at, e.kind, e.hosts, e.hold, e.param);
        for b in text.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::layout::Timing;

    fn layout() -> Layout {
        let t = Timing {
            nag: 10,
            failover_after: 30,
            lifetime: 120,
            gc_grace: 30,
            gc_interval: 20,
        };
        Layout::new(30, 4, 3, true, t)
    }

    fn rates() -> BTreeMap<Kind, f64> {
        Kind::ALL.iter().map(|k| (*k, k.default_rate())).collect()
    }

    #[test]
    fn the_same_seed_draws_the_same_plan_and_another_seed_another() {
        let l = layout();
        let d = Duration::from_secs(1800);
        let a = make(42, &l, &rates(), d, 6);
        let b = make(42, &l, &rates(), d, 6);
        let c = make(43, &l, &rates(), d, 6);
        assert_eq!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a), fingerprint(&c));
        assert!(a.events.len() > 30, "{}", a.events.len());
        let kinds: std::collections::BTreeSet<Kind> = a.events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds.len(), Kind::ALL.len(), "{kinds:?}");
    }

    #[test]
    fn faults_never_overlap_on_a_host_and_at_most_max_active_hold() {
        let l = layout();
        let d = Duration::from_secs(1800);
        let mut r = rates();
        for v in r.values_mut() {
            *v *= 4.0;
        }
        let p = make(7, &l, &r, d, 3);
        let span = |e: &Event| (e.at, e.at + e.hold + Duration::from_secs(15));
        for (i, a) in p.events.iter().enumerate() {
            let (s, e) = span(a);
            assert!(a.at + a.hold <= d);
            let mut overlapping = 0;
            for b in &p.events[..i] {
                let (bs, be) = span(b);
                if bs <= s && s < be {
                    overlapping += 1;
                    assert!(
                        a.hosts.iter().all(|h| !b.hosts.contains(h)),
                        "{a:?} overlaps {b:?}"
                    );
                }
                let _ = e;
            }
            assert!(overlapping < 3, "{a:?}: {overlapping} already hold");
        }
        assert!(
            p.dropped.values().sum::<u64>() > 0,
            "a busy plan drops some"
        );
    }
}
