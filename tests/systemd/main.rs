//! fort under a real, booted systemd (the systemd lane, `fort_tests::lane`): the units
//! and /etc/fort files the NixOS module renders, installed in Debian containers booted
//! with systemd-nspawn, and what systemd reports about them. Skips (through
//! `fort_tests::skip`) where the lane cannot run: not root, no systemd-nspawn or
//! mmdebstrap, no Debian registry for the first build of the root.

mod agent;
mod at_rest;
mod backups;
mod certificates;
mod clients;
mod credentials;
mod databases;
mod delivery;
mod failover;
mod fleet;
mod monitoring;
mod records;
mod releases;
mod ssh;
mod units;
