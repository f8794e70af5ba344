//! Raw transport for tests that play a part no well-behaved fort client plays: pinned
//! TLS connections and servers, hand-made HTTP requests, a relay that records the wire,
//! and an impostor presenting another key.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use fort_core::sign::Signer;

use crate::HostSpec;

/// A TLS stream to an agent, pinned to its key as every fort client pins.
pub type TlsStream = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// Opens a pinned TLS 1.3 connection to `host`'s agent (handshake not yet driven: the
/// first write or read does it).
pub fn tls_connect(host: &HostSpec) -> TlsStream {
    tls_connect_to(host.addr, &host.name, &host.keys())
}

/// A pinned TLS connection to `addr`, expecting one of `keys` (for relays and impostors).
pub fn tls_connect_to(addr: SocketAddr, name: &str, keys: &[ssh_key::PublicKey]) -> TlsStream {
    fort_core::tls::install_default_provider();
    let config = std::sync::Arc::new(fort_core::tls::client_config(name, keys));
    let server_name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let conn = rustls::ClientConnection::new(config, server_name).expect("client connection");
    let tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    rustls::StreamOwned::new(conn, tcp)
}

/// The server end of a TLS connection, for scripted peers that stand in for an agent.
pub type TlsServerStream = rustls::StreamOwned<rustls::ServerConnection, TcpStream>;

/// Serves TLS on an accepted connection as an agent would: a self-signed certificate
/// around `signer`'s key (the handshake runs on the first read or write).
pub fn tls_accept(tcp: TcpStream, signer: &Signer, name: &str) -> TlsServerStream {
    fort_core::tls::install_default_provider();
    let _ = name;
    let config = fort_core::tls::server_config(signer).expect("server config");
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    rustls::StreamOwned::new(
        rustls::ServerConnection::new(config).expect("server connection"),
        tcp,
    )
}

/// A raw HTTP/1.1 exchange over pinned TLS, for requests no well-behaved client would send.
pub fn raw_http(host: &HostSpec, request: &[u8]) -> (u16, String, Vec<u8>) {
    let mut s = tls_connect(host);
    // An agent may answer and close before reading all of a request it refuses.
    let _ = s.write_all(request).and_then(|()| s.flush());
    let mut buf = Vec::new();
    // A close without close_notify is an error for rustls; what was read still counts.
    let _ = s.read_to_end(&mut buf);
    parse_response(&buf)
}

/// A raw HTTP/1.1 exchange over plain TCP (the metrics listener).
pub fn raw_http_plain(addr: SocketAddr, request: &[u8]) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(request).expect("write");
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    parse_response(&buf)
}

fn parse_response(buf: &[u8]) -> (u16, String, Vec<u8>) {
    let text = String::from_utf8_lossy(buf).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (head, body) = match text.find("\r\n\r\n") {
        Some(i) => (text[..i].to_owned(), buf[i + 4..].to_vec()),
        None => (text.clone(), Vec::new()),
    };
    (status, head, body)
}

/// A TCP connection to `addr` from the local address `from` (a 127.0.0.x of the test's
/// choosing): budgets are per peer address, and an attacker is not the operator.
pub fn tcp_connect_from(from: &str, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    let local: SocketAddr = format!("{from}:0").parse().expect("an IPv4 address");
    socket.bind(&local.into())?;
    socket.connect_timeout(&addr.into(), Duration::from_secs(5))?;
    let s: TcpStream = socket.into();
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

/// A pinned TLS connection to `host` from the local address `from`.
pub fn tls_connect_from(from: &str, host: &HostSpec) -> std::io::Result<TlsStream> {
    fort_core::tls::install_default_provider();
    let config = std::sync::Arc::new(fort_core::tls::client_config(&host.name, &host.keys()));
    let server_name = rustls::pki_types::ServerName::IpAddress(host.addr.ip().into());
    let conn = rustls::ClientConnection::new(config, server_name).expect("client connection");
    Ok(rustls::StreamOwned::new(
        conn,
        tcp_connect_from(from, host.addr)?,
    ))
}

/// The four signed headers for a request, computed like any client would.
pub fn signed_headers(
    signer: &Signer,
    origin: &str,
    target: &str,
    path: &str,
    body: &[u8],
    timestamp: u64,
) -> Vec<(String, String)> {
    let nonce = fort_core::client::new_nonce();
    let ts = timestamp.to_string();
    let canonical = fort_core::canonical::request_bytes(target, path, origin, &ts, &nonce, body);
    vec![
        ("X-Fort-Origin".into(), origin.into()),
        ("X-Fort-Timestamp".into(), ts),
        ("X-Fort-Nonce".into(), nonce),
        ("X-Fort-Signature".into(), signer.sign(&canonical)),
    ]
}

/// Builds a raw POST with the given headers and body.
pub fn raw_post(path: &str, headers: &[(String, String)], body: &[u8]) -> Vec<u8> {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// A loopback TCP relay to `target` that records every byte passing in either direction:
/// what someone on the wire between two agents would see.
pub struct Relay {
    pub addr: SocketAddr,
    recorded: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Relay {
    pub fn start(ip: &str, target: SocketAddr) -> Relay {
        let listener = TcpListener::bind(format!("{ip}:0")).expect("bind relay");
        let addr = listener.local_addr().expect("relay addr");
        let recorded = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = recorded.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(target) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (
                        client.try_clone().expect("clone"),
                        server.try_clone().expect("clone"),
                    ),
                    (server, client),
                ] {
                    let log = log.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16384];
                        loop {
                            match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    log.lock().expect("relay log").extend_from_slice(&buf[..n]);
                                    if to.write_all(&buf[..n]).is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Relay { addr, recorded }
    }

    /// Everything that passed so far, both directions interleaved.
    pub fn bytes(&self) -> Vec<u8> {
        self.recorded.lock().expect("relay log").clone()
    }
}

/// A TLS server that is not the host it claims to be: it presents `impostor`'s key and
/// records whatever application bytes it manages to decrypt (none, if the client pins).
pub struct Impostor {
    pub addr: SocketAddr,
    decrypted: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    pub connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Impostor {
    pub fn start(ip: &str, name: &'static str) -> Impostor {
        let listener = TcpListener::bind(format!("{ip}:0")).expect("bind impostor");
        let addr = listener.local_addr().expect("impostor addr");
        let key = Signer::generate();
        let decrypted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (log, count) = (decrypted.clone(), connections.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut tls = tls_accept(stream, &key, name);
                let mut buf = [0u8; 4096];
                while let Ok(n) = tls.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    log.lock()
                        .expect("impostor log")
                        .extend_from_slice(&buf[..n]);
                }
            }
        });
        Impostor {
            addr,
            decrypted,
            connections,
        }
    }

    pub fn decrypted(&self) -> Vec<u8> {
        self.decrypted.lock().expect("impostor log").clone()
    }
}
