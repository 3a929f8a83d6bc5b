//! Connections counted per client address, so that one host cannot take
//! the whole connection cap.
//!
//! An IPv4 address counts alone; IPv6 addresses count by their /64 prefix,
//! the block one host or one customer line is given (a host picks any
//! address in it at will, so counting single addresses would not bound
//! it). An IPv4 address mapped into IPv6 (a dual-stack listener) counts as
//! the IPv4 address it is.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, PoisonError};

/// The addresses whose connections count together: one IPv4 address, or
/// one IPv6 /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum PeerGroup {
    /// One IPv4 address.
    V4(Ipv4Addr),
    /// The upper 64 bits of an IPv6 address.
    V6(u64),
}

impl PeerGroup {
    /// The group `address` counts in.
    pub(super) fn of(address: IpAddr) -> Self {
        match address.to_canonical() {
            IpAddr::V4(v4) => Self::V4(v4),
            IpAddr::V6(v6) => Self::V6((v6.to_bits() >> 64) as u64),
        }
    }
}

/// Connections held per [`PeerGroup`], each at most a cap.
#[derive(Debug, Default)]
pub(super) struct PeerCounts {
    held: Mutex<HashMap<PeerGroup, usize>>,
}

impl PeerCounts {
    /// Counts one more connection of `group` if it holds fewer than `cap`;
    /// the slot is given back when dropped.
    pub(super) fn admit(self: &Arc<Self>, group: PeerGroup, cap: usize) -> Option<PeerSlot> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(group).or_insert(0);
        if *count >= cap {
            return None;
        }
        *count += 1;
        Some(PeerSlot { counts: self.clone(), group })
    }

    /// Connections `group` holds now.
    #[cfg(test)]
    pub(super) fn held(&self, group: PeerGroup) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).get(&group).copied().unwrap_or(0)
    }

    /// Groups holding a connection now.
    #[cfg(test)]
    pub(super) fn groups(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// One connection counted for its group, until dropped.
#[derive(Debug)]
pub(super) struct PeerSlot {
    counts: Arc<PeerCounts>,
    group: PeerGroup,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut held = self.counts.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.group) {
            *count -= 1;
            // A group with nothing held is forgotten: the map holds only
            // the addresses connected now.
            if *count == 0 {
                held.remove(&self.group);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;

    fn group(address: &str) -> PeerGroup {
        PeerGroup::of(address.parse().unwrap())
    }

    #[test]
    fn ipv6_addresses_count_by_their_64_prefix_and_mapped_ipv4_as_ipv4() {
        assert_eq!(group("2001:db8:1:2::1"), group("2001:db8:1:2:ffff:ffff:ffff:ffff"));
        assert_ne!(group("2001:db8:1:2::1"), group("2001:db8:1:3::1"));
        assert_eq!(group("::ffff:192.0.2.7"), group("192.0.2.7"));
        assert_ne!(group("192.0.2.7"), group("192.0.2.8"));
        assert_eq!(PeerGroup::of(IpAddr::V6(Ipv6Addr::LOCALHOST)), PeerGroup::V6(0));
    }

    #[test]
    fn a_group_is_refused_at_its_cap_and_admitted_again_when_a_slot_is_given_back() {
        let counts = Arc::new(PeerCounts::default());
        let (one, other) = (group("192.0.2.1"), group("192.0.2.2"));
        let slots: Vec<PeerSlot> = (0..3).map(|_| counts.admit(one, 3).unwrap()).collect();
        assert!(counts.admit(one, 3).is_none(), "a fourth connection of one address");
        // Another address is not held back by the first.
        let elsewhere = counts.admit(other, 3).unwrap();
        assert_eq!((counts.held(one), counts.held(other)), (3, 1));
        let mut slots = slots.into_iter();
        drop(slots.next());
        assert!(counts.admit(one, 3).is_some(), "a slot given back is free again");
        drop(slots);
        drop(elsewhere);
        assert_eq!(counts.groups(), 0, "groups with nothing held are forgotten");
    }
}
