//! The expert cache: device slots of an expert each, filled and evicted by the policy
//! the run chose (`Eviction`).

/// How the expert cache chooses what to evict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Eviction {
    /// The expert its layer routed the fewest tokens to so far, the least recently used
    /// among equals; a unified backend admits an expert only when it served at least as
    /// many tokens as the one it would evict.
    #[default]
    Frequency,
    /// The least recently used; every loaded expert is admitted (the baseline).
    Lru,
}

impl std::str::FromStr for Eviction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "frequency" => Ok(Eviction::Frequency),
            "lru" => Ok(Eviction::Lru),
            _ => Err(format!("{s:?}: expected frequency or lru")),
        }
    }
}

/// Device slots of an expert each, and which expert each holds.
pub(in crate::pipeline) struct ExpertCache<M> {
    pub(in crate::pipeline) slots: Vec<M>,
    /// (unit, expert) per slot.
    pub(super) holds: Vec<Option<(usize, u32)>>,
    /// Slots whose expert is never evicted (the resident hot experts).
    pub(super) pinned: Vec<bool>,
    last_use: Vec<u64>,
    clock: u64,
}

impl<M> ExpertCache<M> {
    pub(super) fn new(slots: Vec<M>) -> Self {
        let n = slots.len();
        ExpertCache {
            slots,
            holds: vec![None; n],
            pinned: vec![false; n],
            last_use: vec![0; n],
            clock: 0,
        }
    }

    pub(super) fn find(&self, unit: usize, expert: u32) -> Option<usize> {
        self.holds.iter().position(|&h| h == Some((unit, expert)))
    }

    pub(super) fn touch(&mut self, slot: usize) {
        self.clock += 1;
        self.last_use[slot] = self.clock;
    }

    pub(super) fn put(&mut self, slot: usize, unit: usize, expert: u32) {
        self.holds[slot] = Some((unit, expert));
        self.touch(slot);
    }

    /// The slot a new expert goes in, and the routed-token count of the expert it would
    /// evict (None: the slot is free). Free slots first; then the lowest `weight`, the
    /// least recently used among equals; slots whose expert `busy` says the running layer
    /// still needs only when nothing else is left. None when there are no slots.
    pub(super) fn victim(
        &self,
        weight: impl Fn(usize, u32) -> u64,
        busy: impl Fn(usize, u32) -> bool,
    ) -> Option<(usize, Option<u64>)> {
        if let Some(free) = self.holds.iter().position(|h| h.is_none()) {
            return Some((free, None));
        }
        (0..self.slots.len())
            .filter(|&s| !self.pinned[s])
            .filter_map(|s| self.holds[s].map(|(u, e)| (s, u, e)))
            .min_by_key(|&(s, u, e)| (busy(u, e), weight(u, e), self.last_use[s]))
            .map(|(s, u, e)| (s, Some(weight(u, e))))
    }
}
