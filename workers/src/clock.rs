//! The time the queue and the lease heartbeat go by, as epoch milliseconds.
//!
//! Leases, renewals, the self-fencing margin and recovery's grace period are all measured on
//! a [`Clock`], so that they can be tested by moving a clock instead of waiting for real
//! leases. [`SystemClock`] is the wall clock; [`ShiftedClock`] is the wall clock plus an
//! offset that only grows (tests move it forward to make a lease run out, or give two
//! instances clocks that disagree).

use std::fmt::Debug;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

/// A source of the current time.
pub trait Clock: Send + Sync + Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        chrono::Utc::now().timestamp_millis()
    }
}

/// The wall clock moved forward by an offset that [`ShiftedClock::advance`] increases.
#[derive(Debug, Default)]
pub struct ShiftedClock {
    offset_ms: AtomicI64,
}

impl ShiftedClock {
    /// A clock that starts at the wall clock's time.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.offset_ms.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ShiftedClock {
    fn now_ms(&self) -> i64 {
        SystemClock
            .now_ms()
            .saturating_add(self.offset_ms.load(Ordering::SeqCst))
    }
}

/// `d` in milliseconds, saturated.
pub fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shifted_clock_runs_ahead_by_what_it_was_advanced() {
        let clock = ShiftedClock::new();
        let before = SystemClock.now_ms();
        clock.advance(Duration::from_secs(90));
        let now = clock.now_ms();
        assert!(now >= before + 90_000, "{now} vs {before}");
        assert!(now < SystemClock.now_ms() + 91_000);
    }
}
