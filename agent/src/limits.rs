//! Budgets that bound what a peer can hold before it has proven who it is: connections
//! (per listener and per peer address) and the bytes of request bodies still being read.
//! Everything here is about strangers; authenticated work has its own budget in
//! [`crate::auth`]. A budget that is exhausted refuses the newcomer, never evicts.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct PerAddress {
    connections: usize,
    body_bytes: usize,
}

/// Connections and pre-authentication body bytes, globally and per peer address.
pub struct Budgets {
    max_connections: usize,
    max_connections_per_address: usize,
    max_body_bytes: usize,
    max_body_bytes_per_address: usize,
    connections: AtomicUsize,
    body_bytes: AtomicUsize,
    by_address: Mutex<HashMap<IpAddr, PerAddress>>,
    /// Connections that have not carried a verified request yet, oldest first: when the
    /// listener is full, a newcomer displaces the oldest of them, so connections opened
    /// by someone without a key can never keep signed callers out.
    unproven: Mutex<BTreeMap<u64, CancellationToken>>,
    next_id: AtomicU64,
}

/// Why a newcomer was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The listener holds its maximum of connections.
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
        Arc::new(Budgets {
            max_connections: max_connections.max(1),
            max_connections_per_address: max_connections_per_address.max(1),
            max_body_bytes,
            max_body_bytes_per_address,
            connections: AtomicUsize::new(0),
            body_bytes: AtomicUsize::new(0),
            by_address: Mutex::new(HashMap::new()),
            unproven: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(0),
        })
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// Admits one connection from `ip`, or says why not. The permit gives it back on drop.
    /// A full listener makes room by closing its oldest connection that never carried a
    /// verified request (see [`ConnectionPermit::closed`]).
    pub fn connect(self: &Arc<Self>, ip: IpAddr) -> Result<ConnectionPermit, Refusal> {
        let mut map = self.by_address.lock().expect("budget lock");
        let entry = map.entry(ip).or_default();
        if entry.connections >= self.max_connections_per_address {
            return Err(Refusal::Address);
        }
        if self.connections.load(Ordering::Relaxed) >= self.max_connections {
            let mut unproven = self.unproven.lock().expect("unproven lock");
            let Some((_, oldest)) = unproven.pop_first() else {
                return Err(Refusal::Listener);
            };
            // Its permit goes back once its task has closed it; until then the listener
            // holds one connection more than its budget.
            oldest.cancel();
        }
        let entry = map.entry(ip).or_default();
        entry.connections += 1;
        self.connections.fetch_add(1, Ordering::Relaxed);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let closed = CancellationToken::new();
        self.unproven
            .lock()
            .expect("unproven lock")
            .insert(id, closed.clone());
        Ok(ConnectionPermit {
            budgets: self.clone(),
            ip,
            id,
            closed,
            proven: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Reserves `bytes` of body buffer for a request from `ip` whose signature is not yet
    /// checked. `None` when the global or the address's share is taken.
    pub fn reserve_body(self: &Arc<Self>, ip: IpAddr, bytes: usize) -> Option<BodyReservation> {
        let mut map = self.by_address.lock().expect("budget lock");
        if self.body_bytes.load(Ordering::Relaxed) + bytes > self.max_body_bytes {
            return None;
        }
        let entry = map.entry(ip).or_default();
        if entry.body_bytes + bytes > self.max_body_bytes_per_address {
            return None;
        }
        entry.body_bytes += bytes;
        self.body_bytes.fetch_add(bytes, Ordering::Relaxed);
        Some(BodyReservation {
            budgets: self.clone(),
            ip,
            bytes,
        })
    }

    fn release(&self, ip: IpAddr, connections: usize, bytes: usize) {
        let mut map = self.by_address.lock().expect("budget lock");
        if let Some(e) = map.get_mut(&ip) {
            e.connections -= connections;
            e.body_bytes -= bytes;
            if e.connections == 0 && e.body_bytes == 0 {
                map.remove(&ip);
            }
        }
        self.connections.fetch_sub(connections, Ordering::Relaxed);
        self.body_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// One admitted connection.
pub struct ConnectionPermit {
    budgets: Arc<Budgets>,
    ip: IpAddr,
    id: u64,
    closed: CancellationToken,
    proven: Arc<AtomicBool>,
}

impl ConnectionPermit {
    /// Cancelled when the listener closes this connection to make room.
    pub fn closed(&self) -> CancellationToken {
        self.closed.clone()
    }

    /// What a request on this connection uses to mark it as carrying verified requests.
    pub fn trust(&self) -> ConnectionTrust {
        ConnectionTrust {
            budgets: self.budgets.clone(),
            id: self.id,
            proven: self.proven.clone(),
        }
    }
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        self.budgets
            .unproven
            .lock()
            .expect("unproven lock")
            .remove(&self.id);
        self.budgets.release(self.ip, 1, 0);
    }
}

/// Put in each request's extensions: the pipeline marks the connection once a request
/// on it has a verified signature; it is then never closed to make room.
#[derive(Clone)]
pub struct ConnectionTrust {
    budgets: Arc<Budgets>,
    id: u64,
    proven: Arc<AtomicBool>,
}

impl ConnectionTrust {
    pub fn verified(&self) {
        if !self.proven.swap(true, Ordering::Relaxed) {
            self.budgets
                .unproven
                .lock()
                .expect("unproven lock")
                .remove(&self.id);
        }
    }
}

/// Body bytes held while a request's body is read and its signature checked.
pub struct BodyReservation {
    budgets: Arc<Budgets>,
    ip: IpAddr,
    bytes: usize,
}

impl Drop for BodyReservation {
    fn drop(&mut self) {
        self.budgets.release(self.ip, 0, self.bytes);
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

    #[test]
    fn per_address_and_global_caps() {
        let b = Budgets::new(3, 2, 100, 60);
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let c: IpAddr = "127.0.0.3".parse().unwrap();
        let p1 = b.connect(a).unwrap();
        let p2 = b.connect(a).unwrap();
        assert_eq!(b.connect(a).err(), Some(Refusal::Address));
        p1.trust().verified();
        p2.trust().verified();
        let p3 = b.connect(c).unwrap();
        p3.trust().verified();
        // Full of connections that carried verified requests: nobody is displaced.
        assert_eq!(b.connect(c).err(), Some(Refusal::Listener));
        drop(p1);
        let unproven = b.connect(c).unwrap();
        // Full again, but one of them never proved anything: it makes room.
        let d: IpAddr = "127.0.0.4".parse().unwrap();
        let newcomer = b.connect(d).unwrap();
        assert!(unproven.closed().is_cancelled());
        assert!(!newcomer.closed().is_cancelled());
        let r = b.reserve_body(a, 60).unwrap();
        assert!(b.reserve_body(a, 1).is_none());
        assert!(b.reserve_body(c, 40).is_some());
        drop(r);
        assert!(b.reserve_body(a, 60).is_some());
    }
}
