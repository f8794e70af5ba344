//! A copy of every record to a remote syslog server (`[audit] syslog`): RFC 5424 messages
//! over UDP, or over TCP with RFC 6587 framing, made and sent by `fasyslog` from a thread
//! of its own. The trail's files stay the record: a server that is slow, down or gone
//! costs the copy, never the writer, and what could not be sent is counted and logged.

use std::net::ToSocketAddrs;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::io::{BufWriter, Write};
use std::net::TcpStream;

use fasyslog::format::SyslogContext;
use fasyslog::{Facility, Severity};

/// Where the copy goes: `udp://HOST:PORT` or `tcp://HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Target {
    Udp(String),
    Tcp(String),
}

impl TryFrom<String> for Target {
    type Error = String;
    fn try_from(text: String) -> Result<Target, String> {
        Target::parse(&text)
    }
}

impl From<Target> for String {
    fn from(t: Target) -> String {
        match t {
            Target::Udp(a) => format!("udp://{a}"),
            Target::Tcp(a) => format!("tcp://{a}"),
        }
    }
}

impl Target {
    pub fn parse(text: &str) -> Result<Target, String> {
        let (scheme, address) = text
            .split_once("://")
            .ok_or_else(|| format!("{text:?}: expected udp://HOST:PORT or tcp://HOST:PORT"))?;
        let port_ok = address.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if !port_ok || address.contains('/') {
            return Err(format!("{text:?}: expected HOST:PORT after {scheme}://"));
        }
        match scheme {
            "udp" => Ok(Target::Udp(address.to_owned())),
            "tcp" => Ok(Target::Tcp(address.to_owned())),
            _ => Err(format!(
                "{text:?}: {scheme}:// is not a syslog transport fort sends over (udp://, tcp://)"
            )),
        }
    }

    fn connect(&self, host: &str) -> std::io::Result<Conn> {
        let address = match self {
            Target::Udp(a) | Target::Tcp(a) => a,
        };
        let remote = address
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::other(format!("{address} has no address")))?;
        let mut context = SyslogContext::new();
        context
            .facility(Facility::AUTHPRIV)
            .hostname(host.to_owned())
            .appname("fort-agent");
        Ok(match self {
            Target::Udp(_) => {
                let local = if remote.is_ipv6() {
                    "[::]:0"
                } else {
                    "0.0.0.0:0"
                };
                let mut udp = fasyslog::sender::udp(local, remote)?;
                *udp.mut_context() = context;
                Conn::Udp(udp)
            }
            // fasyslog's TCP sender connects and writes without a deadline: a server that
            // accepts and stops reading would hold this thread for good. The stream is made
            // here with deadlines, and fasyslog formats each message.
            Target::Tcp(_) => {
                let stream = TcpStream::connect_timeout(&remote, IO_DEADLINE)?;
                stream.set_write_timeout(Some(IO_DEADLINE))?;
                Conn::Tcp {
                    stream: BufWriter::new(stream),
                    context,
                }
            }
        })
    }
}

/// How long connecting to the server, or one write to it, may take.
const IO_DEADLINE: Duration = Duration::from_secs(5);

/// A connection to the server.
enum Conn {
    Udp(fasyslog::sender::UdpSender),
    Tcp {
        stream: BufWriter<TcpStream>,
        context: SyslogContext,
    },
}

impl Conn {
    fn send(&mut self, line: &str) -> std::io::Result<()> {
        match self {
            Conn::Udp(u) => {
                u.send_rfc5424(Severity::INFORMATIONAL, Some("audit"), Vec::new(), line)
            }
            // RFC 6587's non-transparent framing: each message ends with LF.
            Conn::Tcp { stream, context } => {
                let message = context.format_rfc5424(
                    Severity::INFORMATIONAL,
                    Some("audit"),
                    Vec::new(),
                    Some(line),
                );
                writeln!(stream, "{message}")
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Conn::Udp(_) => Ok(()),
            Conn::Tcp { stream, .. } => stream.flush(),
        }
    }
}

/// Records waiting for the sender; past it they are dropped from the copy (and counted).
const QUEUE: usize = 16_384;

/// How long a server that could not be reached is left before the next try.
const RETRY: Duration = Duration::from_secs(5);

/// How long the trail's close waits for the copy to send what it still holds: the
/// records of a stop (the last checkpoint, `stop`) should reach the server, but a server
/// that does not answer must not hold the agent's stop.
const DRAIN: Duration = Duration::from_secs(3);

/// The writer's handle on the sending thread.
pub(super) struct Forward {
    /// `None` once closed: the sender then sends what is queued and ends.
    lines: Option<SyncSender<Box<str>>>,
    dropped: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Forward {
    /// Starts the sending thread; `dropped` counts the records it could not send.
    pub(super) fn start(target: Target, host: &str, dropped: Arc<AtomicU64>) -> Forward {
        let (lines, rx) = mpsc::sync_channel(QUEUE);
        let sender = Sender {
            target,
            host: host.to_owned(),
            dropped: dropped.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("fort-audit-syslog".into())
            .spawn(move || sender.run(rx))
            .expect("a thread for the audit trail's syslog copy");
        Forward {
            lines: Some(lines),
            dropped,
            thread: Some(thread),
        }
    }

    /// Hands one record's line to the sender; never waits.
    pub(super) fn send(&self, line: &str) {
        let sent = self
            .lines
            .as_ref()
            .is_some_and(|l| l.try_send(line.into()).is_ok());
        if !sent {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Forward {
    /// Closes the queue and waits up to [`DRAIN`] for the sender to send what it holds;
    /// past that the thread is left to finish (or die with the process) on its own.
    fn drop(&mut self) {
        self.lines = None;
        let Some(thread) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + DRAIN;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if thread.is_finished() {
            let _ = thread.join();
        } else {
            tracing::warn!("the audit trail's syslog copy did not finish sending within {DRAIN:?} of the stop; what it still held is not copied");
        }
    }
}

struct Sender {
    target: Target,
    host: String,
    dropped: Arc<AtomicU64>,
}

/// Lines sent together before a stream is flushed.
const BATCH: usize = 256;

impl Sender {
    fn run(self, rx: Receiver<Box<str>>) {
        let mut conn: Option<Conn> = None;
        let mut next_try = Instant::now();
        let mut down: Option<(Instant, u64)> = None;
        // Ends when the writer (and so the channel's sending side) is gone.
        while let Ok(first) = rx.recv() {
            let mut batch = vec![first];
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(line) => batch.push(line),
                    Err(_) => break,
                }
            }
            if conn.is_none() && Instant::now() >= next_try {
                match self.target.connect(&self.host) {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        next_try = Instant::now() + RETRY;
                        self.outage(&mut down, &e);
                    }
                }
            }
            let Some(c) = &mut conn else {
                self.dropped
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                continue;
            };
            let sent = batch
                .iter()
                .try_for_each(|line| c.send(line))
                .and_then(|()| c.flush());
            match sent {
                Ok(()) => {
                    if let Some((since, before)) = down.take() {
                        let now = self.dropped.load(Ordering::Relaxed);
                        tracing::info!(target = ?self.target, after = ?since.elapsed(), not_copied = now.saturating_sub(before), "the audit trail's syslog server answers again");
                    }
                }
                Err(e) => {
                    self.dropped
                        .fetch_add(batch.len() as u64, Ordering::Relaxed);
                    conn = None;
                    next_try = Instant::now() + RETRY;
                    self.outage(&mut down, &e);
                }
            }
        }
    }

    /// Said once per outage, not once per record.
    fn outage(&self, down: &mut Option<(Instant, u64)>, e: &std::io::Error) {
        if down.is_none() {
            tracing::warn!(target = ?self.target, error = %e, "cannot send the audit trail to its syslog server; records stay in the trail's files and are not copied until it answers");
            *down = Some((Instant::now(), self.dropped.load(Ordering::Relaxed)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(
            Target::parse("udp://logs.example:514"),
            Ok(Target::Udp("logs.example:514".into()))
        );
        assert_eq!(
            Target::parse("tcp://[::1]:601"),
            Ok(Target::Tcp("[::1]:601".into()))
        );
        for bad in [
            "logs.example:514",
            "tls://logs.example:6514",
            "udp://logs.example",
            "udp://:514",
            "tcp://logs.example:0",
            "tcp://logs.example:601/x",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }
}
