//! Members' tunnel addresses, derived from the mesh's name and the member's host name:
//! candidate `i` of a member is SHA-256 of `fort-mesh-v1`, the family, the mesh, the host
//! and `i`, taken modulo the prefix's host addresses. Every coordinator of a mesh thus
//! derives the same first candidate for a member, whatever it has seen before; a member
//! whose candidate another member holds takes its next one.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use sha2::{Digest, Sha256};

/// Candidates tried before the addresses after the first one are taken in order.
const PROBES: u32 = 64;

fn digest(family: &str, mesh: &str, host: &str, i: u32) -> u128 {
    let mut h = Sha256::new();
    for part in ["fort-mesh-v1", family, mesh, host] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.update(i.to_be_bytes());
    let out = h.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&out[..16]);
    u128::from_be_bytes(first)
}

/// Host addresses of `net` a member may have: not its network or broadcast address.
pub fn usable4(net: Ipv4Net, a: Ipv4Addr) -> bool {
    net.contains(&a) && a != net.network() && a != net.broadcast()
}

/// Host addresses of `net` a member may have: not the subnet-router anycast address
/// (the prefix itself).
pub fn usable6(net: Ipv6Net, a: Ipv6Addr) -> bool {
    net.contains(&a) && a != net.network()
}

/// Candidate `i` of `host` in `net`: one of its host addresses (1 to size − 2).
pub fn candidate4(mesh: &str, host: &str, net: Ipv4Net, i: u32) -> Ipv4Addr {
    let bits = 32 - u32::from(net.prefix_len());
    let count = (1u128 << bits) - 2;
    let offset = 1 + digest("ipv4", mesh, host, i) % count;
    // The offset is below 2^bits ≤ 2^32, so it fits and the sum stays in the prefix.
    let offset = u32::try_from(offset).unwrap_or(1);
    Ipv4Addr::from(u32::from(net.network()) | offset)
}

/// Candidate `i` of `host` in `net`: one of its host addresses (1 to size − 1).
pub fn candidate6(mesh: &str, host: &str, net: Ipv6Net, i: u32) -> Ipv6Addr {
    let bits = 128 - u32::from(net.prefix_len());
    // Prefix lengths are at least 1 (config), so 2^bits fits in a u128.
    let count = (1u128 << bits) - 1;
    let offset = 1 + digest("ipv6", mesh, host, i) % count;
    Ipv6Addr::from(u128::from(net.network()) | offset)
}

/// The first candidate of `host` that no other member holds: the derived ones first,
/// then (should all of them be taken) the addresses after the first in order, of which
/// one among `taken.len() + 1` is free.
pub fn allocate4(
    mesh: &str,
    host: &str,
    net: Ipv4Net,
    taken: &BTreeSet<Ipv4Addr>,
) -> Option<Ipv4Addr> {
    let probes = (0..PROBES).map(|i| candidate4(mesh, host, net, i));
    let first = u32::from(candidate4(mesh, host, net, 0));
    let size = 1u64 << (32 - u32::from(net.prefix_len()));
    let base = u32::from(net.network());
    let scan = (0..=taken.len() as u64).filter_map(move |step| {
        let offset = (u64::from(first - base) + step) % size;
        Some(Ipv4Addr::from(base | u32::try_from(offset).ok()?))
    });
    probes
        .chain(scan)
        .find(|a| usable4(net, *a) && !taken.contains(a))
}

/// As [`allocate4`], in an IPv6 prefix.
pub fn allocate6(
    mesh: &str,
    host: &str,
    net: Ipv6Net,
    taken: &BTreeSet<Ipv6Addr>,
) -> Option<Ipv6Addr> {
    let probes = (0..PROBES).map(|i| candidate6(mesh, host, net, i));
    let first = u128::from(candidate6(mesh, host, net, 0));
    let bits = 128 - u32::from(net.prefix_len());
    let mask = (1u128 << bits) - 1;
    let base = u128::from(net.network());
    let scan = (0..=taken.len() as u128)
        .map(move |step| Ipv6Addr::from(base | ((first - base).wrapping_add(step) & mask)));
    probes
        .chain(scan)
        .find(|a| usable6(net, *a) && !taken.contains(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_addresses_are_stable_usable_and_spread() {
        let net: Ipv4Net = "10.77.0.0/16".parse().unwrap();
        let a = candidate4("office", "app", net, 0);
        assert_eq!(a, candidate4("office", "app", net, 0));
        assert_ne!(a, candidate4("office", "db", net, 0));
        assert_ne!(a, candidate4("home", "app", net, 0));
        assert_ne!(a, candidate4("office", "app", net, 1));
        // Pinned down (and computed independently): another release must derive the same.
        assert_eq!(a.to_string(), "10.77.228.57");
        let six: Ipv6Net = "fd77:77::/64".parse().unwrap();
        assert_eq!(
            candidate6("office", "app", six, 0).to_string(),
            "fd77:77::ecd2:64f2:5e66:cfa1"
        );
        // Never the network or broadcast address, even in the smallest prefix.
        let tiny: Ipv4Net = "10.0.0.0/30".parse().unwrap();
        for i in 0..200 {
            let c = candidate4("m", &format!("h{i}"), tiny, 0);
            assert!(usable4(tiny, c), "{c}");
        }
        let tiny6: Ipv6Net = "fd00::/126".parse().unwrap();
        for i in 0..200 {
            assert!(usable6(tiny6, candidate6("m", &format!("h{i}"), tiny6, 0)));
        }
    }

    #[test]
    fn a_taken_candidate_moves_on_and_a_full_prefix_says_so() {
        let net: Ipv4Net = "10.0.0.0/30".parse().unwrap();
        let mut taken = BTreeSet::new();
        let first = allocate4("m", "a", net, &taken).unwrap();
        taken.insert(first);
        let second = allocate4("m", "a", net, &taken).unwrap();
        assert_ne!(first, second);
        taken.insert(second);
        assert_eq!(
            allocate4("m", "a", net, &taken),
            None,
            "two host addresses only"
        );
        let six: Ipv6Net = "fd00::/126".parse().unwrap();
        let mut taken6 = BTreeSet::new();
        for _ in 0..3 {
            let a = allocate6("m", "a", six, &taken6).unwrap();
            assert!(taken6.insert(a));
        }
        assert_eq!(allocate6("m", "a", six, &taken6), None);
        // 100 members in a /16: all distinct.
        let wide: Ipv4Net = "10.77.0.0/16".parse().unwrap();
        let mut all = BTreeSet::new();
        for i in 0..100 {
            let a = allocate4("office", &format!("host{i}"), wide, &all).unwrap();
            assert!(all.insert(a));
        }
    }
}
