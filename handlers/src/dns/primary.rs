//! One TCP connection to a zone's primary: RFC 2136 updates and plain queries, every
//! message signed with the TSIG key and every answer's signature verified before it is
//! read. There is no way to build a `Primary` without a key, so nothing unsigned is sent.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use hickory_client::client::Client;
use hickory_client::proto::dnssec::tsig::TSigner;
use hickory_client::proto::op::{
    Message, MessageFinalizer, MessageType, MessageVerifier, OpCode, Query, ResponseCode,
    UpdateMessage,
};
use hickory_client::proto::rr::{DNSClass, Record, RecordType};
use hickory_client::proto::runtime::TokioRuntimeProvider;
use hickory_client::proto::tcp::TcpClientStream;
use hickory_client::proto::xfer::{DnsHandle, DnsRequest, DnsRequestOptions};
use hickory_client::proto::ProtoError;

use super::key::TsigKey;
use super::name::DnsName;
use super::record::{Kind, RecordSet};

/// Where updates for a zone go, and how they are signed.
#[derive(Debug, Clone)]
pub struct Server {
    /// The primary's address (updates and queries go over TCP).
    pub addr: SocketAddr,
    pub zone: DnsName,
    pub key: TsigKey,
    /// How long one message may wait for its answer.
    pub timeout: Duration,
}

/// Why a run cannot go on: the primary is unreachable, refuses the key, or fails.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("no usable answer from the primary {addr}: {detail}")]
    Transport { addr: SocketAddr, detail: String },
    #[error("the primary {addr} answered {rcode} to {what}")]
    Answer {
        addr: SocketAddr,
        what: String,
        rcode: ResponseCode,
    },
    #[error("not sent: {0}")]
    Invalid(String),
}

/// What the primary did with one update.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Applied as a whole.
    Applied,
    /// Refused as a whole (nothing changed), with a one-line reason: a prerequisite did
    /// not hold (records someone else made), or the primary's policy refused it.
    Rejected(String),
}

/// An update message under construction: prerequisites, then deletions and additions,
/// applied by the primary atomically or not at all.
#[derive(Debug, Default, Clone)]
pub struct Update {
    prerequisites: Vec<Record>,
    updates: Vec<Record>,
    /// Every owner name it touches, to say which one a rejection is about.
    names: BTreeSet<DnsName>,
}

impl Update {
    pub fn new() -> Update {
        Update::default()
    }

    /// Prerequisite: no record of `kind` at `name` (RFC 2136 §2.4.3).
    pub fn require_absent(&mut self, name: &DnsName, kind: Kind) -> &mut Self {
        let mut r = Record::update0(name.to_name(), 0, kind.record_type());
        r.set_dns_class(DNSClass::NONE);
        self.prerequisites.push(r);
        self.names.insert(name.clone());
        self
    }

    /// Prerequisite: no record of any type at `name` (RFC 2136 §2.4.5).
    pub fn require_unused(&mut self, name: &DnsName) -> &mut Self {
        let mut r = Record::update0(name.to_name(), 0, RecordType::ANY);
        r.set_dns_class(DNSClass::NONE);
        self.prerequisites.push(r);
        self.names.insert(name.clone());
        self
    }

    /// Deletes exactly these records (by value) and no other at the name (RFC 2136 §2.5.4).
    pub fn delete<'a>(
        &mut self,
        name: &DnsName,
        kind: Kind,
        values: impl IntoIterator<Item = &'a String>,
    ) -> &mut Self {
        for mut r in RecordSet::records(name, kind, 0, values) {
            r.set_dns_class(DNSClass::NONE);
            self.updates.push(r);
        }
        self.names.insert(name.clone());
        self
    }

    /// Adds these records (RFC 2136 §2.5.1); one already there is left as it is.
    pub fn add<'a>(
        &mut self,
        name: &DnsName,
        kind: Kind,
        ttl: u32,
        values: impl IntoIterator<Item = &'a String>,
    ) -> &mut Self {
        self.updates
            .extend(RecordSet::records(name, kind, ttl, values));
        self.names.insert(name.clone());
        self
    }

    pub fn is_empty(&self) -> bool {
        self.updates.is_empty()
    }

    /// How many records it deletes or adds.
    pub fn len(&self) -> usize {
        self.updates.len()
    }

    fn message(&self, zone: &DnsName) -> Message {
        let mut zone_query = Query::new();
        zone_query
            .set_name(zone.to_name())
            .set_query_class(DNSClass::IN)
            .set_query_type(RecordType::SOA);
        let mut message = Message::new();
        message
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Update)
            .set_recursion_desired(false);
        message.add_zone(zone_query);
        message.add_pre_requisites(self.prerequisites.iter().cloned());
        message.add_updates(self.updates.iter().cloned());
        message
    }

    /// The update's size on the wire before it is signed, or why it cannot be sent: a
    /// message a DNS server cannot take fails on the connection, where it would look like
    /// the primary's fault (or the key's), and takes other messages with it.
    fn sized(&self, zone: &DnsName) -> Result<Message, String> {
        let message = self.message(zone);
        let len = message
            .to_vec()
            .map_err(|e| format!("the update of {} cannot be encoded: {e}", self.describe()))?
            .len();
        if len > MESSAGE_MAX {
            return Err(format!(
                "the update of {} would be {len} bytes, more than the {MESSAGE_MAX} a signed \
                 DNS message may hold",
                self.describe()
            ));
        }
        Ok(message)
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.names.iter().map(DnsName::as_str).collect();
        names.join(", ")
    }
}

/// The largest update sent, before its signature: a DNS message over TCP is at most 65,535
/// bytes, and the TSIG record (key and algorithm names, MAC, times) takes at most a few
/// hundred of them.
pub const MESSAGE_MAX: usize = 65_535 - 1024;

/// The TSIG signer, for every message (queries too, so that answers are verified), with
/// failures explained: a primary that does not know the key answers NOTAUTH unsigned.
struct Signing(TSigner);

impl MessageFinalizer for Signing {
    fn finalize_message(
        &self,
        message: &Message,
        current_time: u32,
    ) -> Result<(Vec<Record>, Option<MessageVerifier>), ProtoError> {
        let (records, verifier) = self.0.finalize_message(message, current_time)?;
        let verifier = verifier.map(|mut verify| -> MessageVerifier {
            Box::new(move |bytes: &[u8]| {
                verify(bytes).map_err(|e| {
                    let rcode = Message::from_vec(bytes).map(|m| m.response_code());
                    match rcode {
                        Ok(ResponseCode::NotAuth) => "the primary refused the TSIG signature \
                            (NOTAUTH): its key of that name has another secret or algorithm, \
                            it has no key of that name, or the clocks differ by more than 300 s"
                            .into(),
                        Ok(rcode) => format!(
                            "an answer ({rcode}) failed TSIG verification, so it is not read: {e}"
                        )
                        .into(),
                        Err(_) => e,
                    }
                })
            })
        });
        Ok((records, verifier))
    }

    fn should_finalize_message(&self, _: &Message) -> bool {
        true
    }
}

/// A connection to the primary. The background task that drives it stops on drop.
pub struct Primary {
    client: Client,
    zone: DnsName,
    addr: SocketAddr,
    background: tokio::task::JoinHandle<()>,
}

impl Drop for Primary {
    fn drop(&mut self) {
        self.background.abort();
    }
}

impl Primary {
    /// Opens the connection (lazily: an unreachable primary fails the first message).
    pub async fn connect(server: &Server) -> Result<Primary, DnsError> {
        let (stream, sender) = TcpClientStream::new(
            server.addr,
            None,
            Some(server.timeout),
            TokioRuntimeProvider::new(),
        );
        let signer: Arc<dyn MessageFinalizer> = Arc::new(Signing(server.key.signer()));
        let (client, background) =
            Client::with_timeout(stream, sender, server.timeout, Some(signer))
                .await
                .map_err(|e| DnsError::Transport {
                    addr: server.addr,
                    detail: e.to_string(),
                })?;
        let background = tokio::spawn(async move {
            let _ = background.await;
        });
        Ok(Primary {
            client,
            zone: server.zone.clone(),
            addr: server.addr,
            background,
        })
    }

    pub fn zone(&self) -> &DnsName {
        &self.zone
    }

    async fn exchange(&self, message: Message) -> Result<Message, DnsError> {
        let mut options = DnsRequestOptions::default();
        options.recursion_desired = false;
        let mut answers = self.client.send(DnsRequest::new(message, options));
        match answers.next().await {
            Some(Ok(response)) => Ok(response.into_message()),
            Some(Err(e)) => Err(DnsError::Transport {
                addr: self.addr,
                detail: e.to_string(),
            }),
            None => Err(DnsError::Transport {
                addr: self.addr,
                detail: "the connection closed without an answer".into(),
            }),
        }
    }

    /// Sends one update. A rejection of the update itself (a prerequisite, the primary's
    /// update policy, a name outside its zone) is an `Outcome`; anything else (no answer,
    /// a key it refuses, a server failure) is an error that must stop the run.
    pub async fn update(&self, update: &Update) -> Result<Outcome, DnsError> {
        if let Some(outside) = update.names.iter().find(|n| !n.is_in(&self.zone)) {
            return Ok(Outcome::Rejected(format!(
                "{outside} is not in the zone {}",
                self.zone
            )));
        }
        let message = match update.sized(&self.zone) {
            Ok(m) => m,
            Err(why) => return Ok(Outcome::Rejected(why)),
        };
        let answer = self.exchange(message).await?;
        let names = update.describe();
        let rejected = |why: String| Ok(Outcome::Rejected(why));
        match answer.response_code() {
            ResponseCode::NoError => Ok(Outcome::Applied),
            ResponseCode::YXDomain | ResponseCode::YXRRSet => rejected(format!(
                "{names} already holds records that fort did not make (the primary answered {})",
                answer.response_code()
            )),
            ResponseCode::NXRRSet | ResponseCode::NXDomain => rejected(format!(
                "the records at {names} changed outside fort (the primary answered {})",
                answer.response_code()
            )),
            ResponseCode::Refused => rejected(format!(
                "the primary's update policy refuses changes at {names} (REFUSED)"
            )),
            ResponseCode::NotZone => rejected(format!(
                "the primary does not serve {names} in the zone {} (NOTZONE)",
                self.zone
            )),
            rcode => Err(DnsError::Answer {
                addr: self.addr,
                what: format!("an update of {names}"),
                rcode,
            }),
        }
    }

    /// The values the primary answers for `name` and `kind` (none when the name or the
    /// record set does not exist).
    pub async fn lookup(&self, name: &DnsName, kind: Kind) -> Result<BTreeSet<String>, DnsError> {
        let mut message = Message::new();
        message
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(false);
        message.add_query(Query::query(name.to_name(), kind.record_type()));
        let answer = self.exchange(message).await?;
        match answer.response_code() {
            ResponseCode::NoError | ResponseCode::NXDomain => {}
            rcode => {
                return Err(DnsError::Answer {
                    addr: self.addr,
                    what: format!("a query for {name} {kind}"),
                    rcode,
                })
            }
        }
        let owner = name.to_name();
        Ok(answer
            .answers()
            .iter()
            .filter(|r| r.record_type() == kind.record_type() && r.name().eq_case(&owner))
            .filter_map(|r| kind.value_of(r.data()))
            .collect())
    }

    /// Asks for the zone's SOA, signed like everything else: a primary that answers it is
    /// up and takes the key, so a failed update beside it was that update's own.
    pub async fn probe(&self) -> Result<(), DnsError> {
        let mut message = Message::new();
        message
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(false);
        message.add_query(Query::query(self.zone.to_name(), RecordType::SOA));
        match self.exchange(message).await?.response_code() {
            ResponseCode::NoError => Ok(()),
            rcode => Err(DnsError::Answer {
                addr: self.addr,
                what: format!("a query for the SOA of {}", self.zone),
                rcode,
            }),
        }
    }

    // The TXT record API that ACME DNS-01 validation uses (`_acme-challenge.<domain>`):
    // several challenges may be pending at one name, so values are added beside the others
    // and each is deleted alone.

    /// Adds `values` to the TXT record set at `name`, beside any other values there.
    pub async fn set_txt(
        &self,
        name: &DnsName,
        values: &[String],
        ttl: u32,
    ) -> Result<Outcome, DnsError> {
        let values = canonical_txt(values)?;
        let mut update = Update::new();
        update
            .require_absent(name, Kind::Cname)
            .add(name, Kind::Txt, ttl, &values);
        self.update(&update).await
    }

    /// Deletes exactly the TXT record `value` at `name`; other values stay.
    pub async fn delete_txt(&self, name: &DnsName, value: &str) -> Result<Outcome, DnsError> {
        let values = canonical_txt(&[value.to_owned()])?;
        let mut update = Update::new();
        update.delete(name, Kind::Txt, &values);
        self.update(&update).await
    }

    /// Whether the primary answers `value` among the TXT records at `name`.
    pub async fn answers_txt(&self, name: &DnsName, value: &str) -> Result<bool, DnsError> {
        Ok(self.lookup(name, Kind::Txt).await?.contains(value))
    }
}

/// TXT values checked as a request's would be: a bad one is a caller's bug, not the
/// primary's, and must never reach the wire.
fn canonical_txt(values: &[String]) -> Result<BTreeSet<String>, DnsError> {
    values
        .iter()
        .map(|v| Kind::Txt.canonical(v))
        .collect::<Result<_, _>>()
        .map_err(DnsError::Invalid)
}
