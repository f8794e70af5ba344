//! Budgets that bound what a peer can hold before it has proven who it is: connections
//! (per listener and per peer address) and the bytes of request bodies still being read.
//! Everything here is about strangers; authenticated work has its own budget in
//! [`crate::auth`].
//!
//! A peer "address" is an IPv4 address or an IPv6 /64 (one IPv6 subscriber holds a
//! whole /64, so counting single IPv6 addresses would count nothing). Connections start
//! unverified; once a request on one has a verified signature it is proven, and proven
//! connections are never closed to make room. When a listener is full, the newcomer takes
//! the place of the oldest unverified connection of the address that holds the most of
//! them: whoever floods the listener with connections that prove nothing loses its own.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use tokio_util::sync::CancellationToken;

/// What budgets are kept per: an IPv4 address, or an IPv6 /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddressKey(u128);

impl AddressKey {
    pub fn of(ip: IpAddr) -> AddressKey {
        match ip {
            IpAddr::V4(v4) => AddressKey(u32::from(v4) as u128),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => AddressKey(u32::from(v4) as u128),
                None => AddressKey((u128::from(v6) >> 64) << 64 | 1 << 63),
            },
        }
    }
}

#[derive(Default)]
struct PerAddress {
    connections: usize,
    body_bytes: usize,
    /// Unverified connections of this address, oldest first.
    unverified: BTreeMap<u64, CancellationToken>,
}

#[derive(Default)]
struct Table {
    by_address: HashMap<AddressKey, PerAddress>,
    connections: usize,
    body_bytes: usize,
}

/// Connections and pre-authentication body bytes, globally and per peer address.
pub struct Budgets {
    max_connections: usize,
    max_connections_per_address: usize,
    max_unverified_per_address: usize,
    max_body_bytes: usize,
    max_body_bytes_per_address: usize,
    table: Mutex<Table>,
    connections: AtomicUsize,
    next_id: AtomicU64,
    evicted: AtomicU64,
}

/// Why a newcomer was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The listener holds its maximum of connections, all of them proven.
    Listener,
    /// This peer address holds its maximum.
    Address,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Listener => "listener_full",
            Refusal::Address => "address_full",
        }
    }
}

impl Budgets {
    pub fn new(
        max_connections: usize,
        max_connections_per_address: usize,
        max_body_bytes: usize,
        max_body_bytes_per_address: usize,
    ) -> Arc<Budgets> {
        let per_address = max_connections_per_address.max(1);
        Arc::new(Budgets {
            max_connections: max_connections.max(1),
            max_connections_per_address: per_address,
            // An honest peer opens a few connections at a time and proves them at once.
            max_unverified_per_address: (per_address / 2).max(4),
            max_body_bytes,
            max_body_bytes_per_address,
            table: Mutex::new(Table::default()),
            connections: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        })
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// Unverified connections closed to make room, since start.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Admits one connection from `ip`, or says why not. The permit gives it back on drop.
    pub fn connect(self: &Arc<Self>, ip: IpAddr) -> Result<ConnectionPermit, Refusal> {
        let key = AddressKey::of(ip);
        let mut table = self.table.lock();
        if let Some(a) = table.by_address.get(&key) {
            if a.connections >= self.max_connections_per_address
                || a.unverified.len() >= self.max_unverified_per_address
            {
                return Err(Refusal::Address);
            }
        }
        if table.connections >= self.max_connections {
            // The address holding the most unverified connections gives up its oldest.
            let victim = table
                .by_address
                .iter_mut()
                .filter(|(_, a)| !a.unverified.is_empty())
                .max_by_key(|(_, a)| a.unverified.len())
                .and_then(|(_, a)| a.unverified.pop_first());
            let Some((_, token)) = victim else {
                return Err(Refusal::Listener);
            };
            // Its permit goes back once its task has closed it; until then the listener
            // holds one connection more than its budget.
            token.cancel();
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let closed = CancellationToken::new();
        let entry = table.by_address.entry(key).or_default();
        entry.connections += 1;
        entry.unverified.insert(id, closed.clone());
        table.connections += 1;
        self.connections.store(table.connections, Ordering::Relaxed);
        Ok(ConnectionPermit {
            budgets: self.clone(),
            key,
            id,
            closed,
            proven: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Reserves `bytes` more of body buffer for a request from `ip` whose signature is
    /// not yet checked. `false` when the global or the address's share is taken.
    fn reserve(&self, key: AddressKey, bytes: usize) -> bool {
        let mut table = self.table.lock();
        if table.body_bytes + bytes > self.max_body_bytes {
            return false;
        }
        let Some(entry) = table.by_address.get_mut(&key) else {
            return false;
        };
        if entry.body_bytes + bytes > self.max_body_bytes_per_address {
            return false;
        }
        entry.body_bytes += bytes;
        table.body_bytes += bytes;
        true
    }

    fn release_bytes(&self, key: AddressKey, bytes: usize) {
        let mut table = self.table.lock();
        if let Some(e) = table.by_address.get_mut(&key) {
            e.body_bytes -= bytes;
        }
        table.body_bytes -= bytes;
    }

    fn release_connection(&self, key: AddressKey, id: u64) {
        let mut table = self.table.lock();
        let gone = table.by_address.get_mut(&key).is_some_and(|e| {
            e.unverified.remove(&id);
            e.connections -= 1;
            e.connections == 0
        });
        if gone {
            table.by_address.remove(&key);
        }
        table.connections -= 1;
        self.connections.store(table.connections, Ordering::Relaxed);
    }

    fn prove(&self, key: AddressKey, id: u64) {
        let mut table = self.table.lock();
        if let Some(e) = table.by_address.get_mut(&key) {
            e.unverified.remove(&id);
        }
    }
}

/// One admitted connection.
pub struct ConnectionPermit {
    budgets: Arc<Budgets>,
    key: AddressKey,
    id: u64,
    closed: CancellationToken,
    proven: Arc<AtomicBool>,
}

impl ConnectionPermit {
    /// Cancelled when the listener closes this connection to make room.
    pub fn closed(&self) -> CancellationToken {
        self.closed.clone()
    }

    /// What the requests on this connection carry: its budgets, and the mark it gets
    /// once one of them has a verified signature.
    pub fn trust(&self) -> ConnectionTrust {
        ConnectionTrust {
            budgets: self.budgets.clone(),
            key: self.key,
            id: self.id,
            proven: self.proven.clone(),
        }
    }
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        self.budgets.release_connection(self.key, self.id);
    }
}

/// Put in each request's extensions: the connection's budgets and trust.
#[derive(Clone)]
pub struct ConnectionTrust {
    budgets: Arc<Budgets>,
    key: AddressKey,
    id: u64,
    proven: Arc<AtomicBool>,
}

impl ConnectionTrust {
    /// A request on this connection had a verified signature: it is never closed to
    /// make room, and its bodies no longer count against the unverified budget.
    pub fn verified(&self) {
        if !self.proven.swap(true, Ordering::Relaxed) {
            self.budgets.prove(self.key, self.id);
        }
    }

    pub fn is_proven(&self) -> bool {
        self.proven.load(Ordering::Relaxed)
    }

    /// A reservation that grows with the bytes of one body as they arrive.
    pub fn body(&self) -> BodyReservation {
        BodyReservation {
            budgets: self.budgets.clone(),
            key: self.key,
            bytes: 0,
            exempt: self.is_proven(),
        }
    }
}

/// Body bytes held while a request's body is read and its signature checked. What a
/// stranger holds is what it actually sent, not what it claims it will send.
pub struct BodyReservation {
    budgets: Arc<Budgets>,
    key: AddressKey,
    bytes: usize,
    /// A proven connection's bodies are bounded by the body limit alone.
    exempt: bool,
}

impl BodyReservation {
    /// Takes `n` more bytes; `false` when the budget has no room for them.
    pub fn grow(&mut self, n: usize) -> bool {
        if self.exempt {
            return true;
        }
        if !self.budgets.reserve(self.key, n) {
            return false;
        }
        self.bytes += n;
        true
    }
}

impl Drop for BodyReservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budgets.release_bytes(self.key, self.bytes);
        }
    }
}

/// Raises the soft descriptor limit to the hard one (what systemd's `LimitNOFILE` grants)
/// and returns the soft limit now in force.
#[allow(unsafe_code)]
pub fn raise_descriptor_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    lim.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn per_address_and_global_caps_and_who_makes_room() {
        let b = Budgets::new(3, 2, 100, 60);
        let p1 = b.connect(ip("127.0.0.2")).unwrap();
        let p2 = b.connect(ip("127.0.0.2")).unwrap();
        assert_eq!(b.connect(ip("127.0.0.2")).err(), Some(Refusal::Address));
        p1.trust().verified();
        p2.trust().verified();
        let p3 = b.connect(ip("127.0.0.3")).unwrap();
        p3.trust().verified();
        // Full of proven connections: nobody is displaced.
        assert_eq!(b.connect(ip("127.0.0.3")).err(), Some(Refusal::Listener));
        drop(p1);
        let unverified = b.connect(ip("127.0.0.3")).unwrap();
        // Full again, and one of them proves nothing: it makes room.
        let newcomer = b.connect(ip("127.0.0.4")).unwrap();
        assert!(unverified.closed().is_cancelled());
        assert!(!newcomer.closed().is_cancelled());
        assert_eq!(b.evicted(), 1);
    }

    #[test]
    fn the_address_with_most_unverified_connections_pays() {
        let b = Budgets::new(6, 8, 100, 60);
        let flood: Vec<_> = (0..4).map(|_| b.connect(ip("10.0.0.9")).unwrap()).collect();
        let honest = b.connect(ip("10.0.0.1")).unwrap();
        let _proven = {
            let p = b.connect(ip("10.0.0.2")).unwrap();
            p.trust().verified();
            p
        };
        let _newcomer = b.connect(ip("10.0.0.3")).unwrap();
        assert!(flood[0].closed().is_cancelled());
        assert!(!honest.closed().is_cancelled());
    }

    #[test]
    fn ipv6_counts_per_64_and_body_bytes_per_address() {
        assert_eq!(
            AddressKey::of(ip("2001:db8::1")),
            AddressKey::of(ip("2001:db8::ffff:1"))
        );
        assert_ne!(
            AddressKey::of(ip("2001:db8::1")),
            AddressKey::of(ip("2001:db8:0:1::1"))
        );
        let b = Budgets::new(10, 10, 100, 60);
        let a = b.connect(ip("127.0.0.2")).unwrap();
        let c = b.connect(ip("127.0.0.3")).unwrap();
        let mut r = a.trust().body();
        assert!(r.grow(60));
        assert!(!r.grow(1), "the address's share is used up");
        assert!(c.trust().body().grow(40));
        drop(r);
        assert!(a.trust().body().grow(60));
        // A proven connection's bodies are not counted.
        a.trust().verified();
        assert!(a.trust().body().grow(1_000_000));
    }
}
