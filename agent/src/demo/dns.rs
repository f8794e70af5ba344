//! The demo's DNS: the ACME CA must resolve the names it validates, and `.test` names
//! resolve nowhere. A thread answers UDP queries on loopback: every name under
//! `demo.test` has the A record 127.0.0.1 (where the demo's nginx answers HTTP-01
//! challenges), every other name or type is answered empty. Messages are read and written
//! with hickory's wire types.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};

/// The zone it answers for.
pub(super) const ZONE: &str = "demo.test.";

/// The responder; its thread ends when this is dropped.
pub(super) struct DemoDns {
    pub(super) addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl DemoDns {
    pub(super) fn start() -> anyhow::Result<DemoDns> {
        let socket = UdpSocket::bind("127.0.0.1:0")?;
        // Woken up now and then to see whether the demo is over.
        socket.set_read_timeout(Some(Duration::from_millis(200)))?;
        let addr = socket.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let zone = Name::from_str(ZONE)?;
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !stopped.load(Ordering::Relaxed) {
                let Ok((n, from)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                if let Some(reply) = answer(&zone, &buf[..n]) {
                    let _ = socket.send_to(&reply, from);
                }
            }
        });
        Ok(DemoDns { addr, stop })
    }
}

impl Drop for DemoDns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The reply to one query message; `None` for what is no query.
fn answer(zone: &Name, query: &[u8]) -> Option<Vec<u8>> {
    let query = Message::from_vec(query).ok()?;
    if query.message_type() != MessageType::Query {
        return None;
    }
    let mut reply = Message::new();
    reply
        .set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_authoritative(true)
        .add_queries(query.queries().to_vec());
    for q in query.queries() {
        if !zone.zone_of(q.name()) {
            reply.set_response_code(ResponseCode::Refused);
        } else if q.query_type() == RecordType::A {
            let a = RData::A(A(Ipv4Addr::LOCALHOST));
            reply.add_answer(Record::from_rdata(q.name().clone(), 60, a));
        }
    }
    reply.to_vec().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;

    fn ask(name: &str, rtype: RecordType) -> Message {
        let mut q = Message::new();
        q.set_id(7)
            .add_query(Query::query(Name::from_str(name).unwrap(), rtype));
        let zone = Name::from_str(ZONE).unwrap();
        Message::from_vec(&answer(&zone, &q.to_vec().unwrap()).unwrap()).unwrap()
    }

    #[test]
    fn names_of_the_zone_are_loopback_and_others_are_refused() {
        let a = ask("wiki.demo.test.", RecordType::A);
        assert_eq!(a.id(), 7);
        assert_eq!(a.answers().len(), 1);
        assert_eq!(a.answers()[0].data(), &RData::A(A(Ipv4Addr::LOCALHOST)));
        let aaaa = ask("wiki.demo.test.", RecordType::AAAA);
        assert_eq!(aaaa.response_code(), ResponseCode::NoError);
        assert!(aaaa.answers().is_empty());
        assert_eq!(
            ask("example.org.", RecordType::A).response_code(),
            ResponseCode::Refused
        );
    }
}
