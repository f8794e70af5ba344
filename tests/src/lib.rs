//! fort test harness.
