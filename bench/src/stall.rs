//! Strangers stalling an agent: connections that finish TLS, send well-formed headers
//! naming a real origin with a signature from another key and `Content-Length: 100`, and
//! then never send the body, each held until the agent closes it and then opened again.
//! Spread over several loopback addresses, as an attacker with a few machines would.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fort_core::sign::Signer;
use fort_tests::HostSpec;

pub struct Staller {
    stop: Arc<AtomicBool>,
    /// Connections whose headers were sent and that are still open.
    pub held: Arc<AtomicUsize>,
    /// Connections opened in all (each reopening counts).
    pub opened: Arc<AtomicU64>,
    /// Connections the agent closed before their headers could be sent.
    pub shed: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Staller {
    /// `n` stalled connections to `host`, `per_address` from each of 127.77.x.y.
    pub fn start(host: &HostSpec, origin: &str, n: usize, per_address: usize) -> Staller {
        let stop = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicUsize::new(0));
        let opened = Arc::new(AtomicU64::new(0));
        let shed = Arc::new(AtomicU64::new(0));
        let stranger = Signer::generate();
        let host = Arc::new(HostSpec {
            name: host.name.clone(),
            addr: host.addr,
            signer: host.signer.clone(),
            needs: Default::default(),
            capabilities: Default::default(),
            extra_toml: String::new(),
            spawn: Default::default(),
        });
        let mut threads = Vec::new();
        for i in 0..n {
            let a = i / per_address.max(1);
            let from = format!("127.77.{}.{}", a / 250, 1 + a % 250);
            let (stop, held, opened, shed, host) = (
                stop.clone(),
                held.clone(),
                opened.clone(),
                shed.clone(),
                host.clone(),
            );
            let head = stalled_head(&stranger, origin, &host.name);
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = fort_tests::tls_connect_from(&from, &host) else {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    };
                    opened.fetch_add(1, Ordering::Relaxed);
                    if s.write_all(&head).and_then(|_| s.flush()).is_err() {
                        // Shed by the agent before the headers went out: try again soon,
                        // as a patient attacker would (a tight loop is a handshake flood,
                        // another attack, which burns this machine's cores instead).
                        shed.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                    held.fetch_add(1, Ordering::Relaxed);
                    let _ = s.sock.set_read_timeout(Some(Duration::from_millis(200)));
                    let mut buf = [0u8; 1024];
                    // Held until the agent answers or closes; then a new one.
                    while !stop.load(Ordering::Relaxed) {
                        match s.read(&mut buf) {
                            Ok(_) => break,
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) => {}
                            Err(_) => break,
                        }
                    }
                    held.fetch_sub(1, Ordering::Relaxed);
                }
            }));
        }
        Staller {
            stop,
            held,
            opened,
            shed,
            threads,
        }
    }
}

fn stalled_head(stranger: &Signer, origin: &str, target: &str) -> Vec<u8> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let path = "/agent/capabilities/status";
    let body = [b'x'; 100];
    let mut head =
        format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nContent-Type: application/json\r\n");
    for (k, v) in fort_tests::signed_headers(stranger, origin, target, path, &body, now) {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head.into_bytes()
}

impl Drop for Staller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
