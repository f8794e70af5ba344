//! The ACME side of one entry, on instant-acme: the account (made once, kept in the
//! state), placing an order and publishing its challenge answers, moving an order on
//! (finalize with the consumer's CSR, fetch the certificate), removing what was published,
//! and revocation. Each step is a few requests; none waits for the CA.

use std::path::{Path, PathBuf};

use instant_acme::{
    Account, AuthorizationStatus, ChallengeType, ExternalAccountKey, Identifier, NewAccount,
    NewOrder, Order, OrderStatus, RevocationRequest,
};
use tokio::sync::OnceCell;

use super::config::Checked;
use super::request::{challenge_name, Request};
use super::state::{AccountRecord, Issued, Published};
use crate::dns::{DnsError, DnsName, Outcome, Primary};

/// Why one entry's step did not go through.
#[derive(Debug)]
pub enum StepError {
    /// The CA answered with a problem for this order: back off this entry.
    Ca { reason: String, refused: bool },
    /// The CA or the DNS primary could not be reached or failed: the run fails.
    Down(String),
}

impl StepError {
    pub fn from_acme(e: instant_acme::Error) -> StepError {
        match e {
            instant_acme::Error::Api(p) => {
                let kind = p
                    .r#type
                    .as_deref()
                    .and_then(|t| t.strip_prefix("urn:ietf:params:acme:error:"))
                    .unwrap_or("error")
                    .to_owned();
                // What the CA will not do for this request again, whatever the wait.
                let refused = matches!(
                    kind.as_str(),
                    "rejectedIdentifier" | "caa" | "badCSR" | "unsupportedIdentifier"
                );
                let detail = p.detail.unwrap_or_default();
                StepError::Ca {
                    reason: format!("the CA answered {kind}: {detail}"),
                    refused,
                }
            }
            other => StepError::Down(format!("the CA: {other}")),
        }
    }
}

impl From<DnsError> for StepError {
    fn from(e: DnsError) -> StepError {
        StepError::Down(e.to_string())
    }
}

/// What a step came to.
pub enum Step {
    /// An order was placed (or is still validating): its record.
    Waiting {
        url: String,
        published: Vec<Published>,
        why: String,
    },
    /// The certificate.
    Issued(Issued),
    /// The order ended without a certificate; what it published is removed.
    Failed { reason: String, refused: bool },
}

/// What every step shares: the account, the DNS primary (connected on first use).
pub struct Ctx<'a> {
    pub checked: &'a Checked,
    pub account: Option<Account>,
    pub primary: OnceCell<Primary>,
    pub ca: String,
}

impl Ctx<'_> {
    fn account(&self) -> Result<&Account, StepError> {
        self.account
            .as_ref()
            .ok_or_else(|| StepError::Down("no ACME account".into()))
    }

    async fn primary(&self) -> Result<&Primary, StepError> {
        let (_, server) = self
            .checked
            .dns
            .as_ref()
            .ok_or_else(|| StepError::Down("no dns01 is configured".into()))?;
        Ok(self
            .primary
            .get_or_try_init(|| Primary::connect(server))
            .await?)
    }

    fn webroot_file(&self, token: &str) -> Option<PathBuf> {
        let root = &self.checked.config.http01.as_ref()?.webroot;
        Some(root.join(".well-known/acme-challenge").join(token))
    }
}

/// The account: restored from the state, or made at the CA (and recorded by the caller).
pub async fn account(
    checked: &Checked,
    saved: Option<&AccountRecord>,
) -> Result<(Account, Option<AccountRecord>), StepError> {
    let config = &checked.config;
    let builder = || match &config.ca_root {
        Some(root) => Account::builder_with_root(root),
        None => Account::builder(),
    };
    let builder = builder().map_err(|e| StepError::Down(format!("the ACME client: {e}")))?;
    if let Some(saved) = saved.filter(|s| s.directory == config.directory) {
        let json = serde_json::to_value(&saved.credentials)
            .map_err(|e| StepError::Down(format!("the saved account: {e}")))?;
        let credentials = serde_json::from_value(json)
            .map_err(|e| StepError::Down(format!("the saved account: {e}")))?;
        let account = builder
            .from_credentials(credentials)
            .await
            .map_err(StepError::from_acme)?;
        return Ok((account, None));
    }
    let contact: Vec<&str> = config.contact.iter().map(String::as_str).collect();
    let eab = checked
        .eab
        .as_ref()
        .map(|(id, key)| ExternalAccountKey::new(id.clone(), key));
    let (account, credentials) = builder
        .create(
            &NewAccount {
                contact: &contact,
                terms_of_service_agreed: true,
                only_return_existing: false,
            },
            config.directory.clone(),
            eab.as_ref(),
        )
        .await
        .map_err(StepError::from_acme)?;
    Ok((
        account,
        Some(AccountRecord {
            directory: config.directory.clone(),
            credentials,
        }),
    ))
}

/// A CA token becomes a file name only when it is base64url, as RFC 8555 §8.3 says.
fn token_ok(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= 256
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Places an order for `request`, publishes an answer for every pending authorization
/// and tells the CA to validate. Published answers are returned even when a later one
/// fails, so they are removed.
pub async fn place(ctx: &Ctx<'_>, request: &Request) -> Result<Step, StepError> {
    let ids: Vec<Identifier> = request
        .names
        .iter()
        .map(|n| Identifier::Dns(n.clone()))
        .collect();
    let mut order = ctx
        .account()?
        .new_order(&NewOrder::new(&ids))
        .await
        .map_err(StepError::from_acme)?;
    let url = order.url().to_owned();
    let mut published = Vec::new();
    match publish(ctx, &mut order, &mut published).await {
        Ok(()) => Ok(Step::Waiting {
            url,
            published,
            why: format!("order placed at {}; waiting for validation", ctx.ca),
        }),
        Err(e) => {
            unpublish(ctx, &published).await?;
            match e {
                StepError::Ca { reason, refused } => Ok(Step::Failed { reason, refused }),
                down => Err(down),
            }
        }
    }
}

async fn publish(
    ctx: &Ctx<'_>,
    order: &mut Order,
    published: &mut Vec<Published>,
) -> Result<(), StepError> {
    let dns_zone: Option<&DnsName> = ctx.checked.dns.as_ref().map(|(z, _)| z);
    let mut authorizations = order.authorizations();
    while let Some(authz) = authorizations.next().await {
        let mut authz = authz.map_err(StepError::from_acme)?;
        if authz.status != AuthorizationStatus::Pending {
            continue;
        }
        let id = authz.identifier();
        let name = id.to_string();
        let record = DnsName::parse(&challenge_name(&name)).map_err(|e| StepError::Ca {
            reason: format!("{name}: {e}"),
            refused: true,
        })?;
        let use_dns = match (dns_zone, &ctx.checked.config.http01) {
            (Some(zone), http) => id.wildcard || http.is_none() || record.is_in(zone),
            (None, _) => false,
        };
        if use_dns {
            if !dns_zone.is_some_and(|z| record.is_in(z)) {
                return Err(StepError::Ca {
                    reason: format!("{name} is not in the zone DNS-01 records are made in"),
                    refused: true,
                });
            }
            let mut challenge =
                authz
                    .challenge(ChallengeType::Dns01)
                    .ok_or_else(|| StepError::Ca {
                        reason: format!("the CA offers no dns-01 for {name}"),
                        refused: true,
                    })?;
            let value = challenge.key_authorization().dns_value();
            let ttl = ctx.checked.config.dns01.as_ref().map_or(60, |d| d.ttl);
            match ctx
                .primary()
                .await?
                .set_txt(&record, std::slice::from_ref(&value), ttl)
                .await?
            {
                Outcome::Applied => {}
                Outcome::Rejected(why) => {
                    return Err(StepError::Ca {
                        reason: why,
                        refused: false,
                    });
                }
            }
            published.push(Published::DnsTxt {
                name: record.as_str().to_owned(),
                value,
            });
            challenge.set_ready().await.map_err(StepError::from_acme)?;
        } else {
            if id.wildcard {
                return Err(StepError::Ca {
                    reason: format!("{name} is a wildcard name, and DNS-01 is not configured"),
                    refused: true,
                });
            }
            let mut challenge =
                authz
                    .challenge(ChallengeType::Http01)
                    .ok_or_else(|| StepError::Ca {
                        reason: format!("the CA offers no http-01 for {name}"),
                        refused: true,
                    })?;
            if !token_ok(&challenge.token) {
                return Err(StepError::Down(
                    "the CA sent a challenge token that is not base64url".into(),
                ));
            }
            let path = ctx
                .webroot_file(&challenge.token)
                .ok_or_else(|| StepError::Down("no http01 webroot is configured".into()))?;
            write_public(&path, challenge.key_authorization().as_str().as_bytes())?;
            published.push(Published::HttpFile {
                token: challenge.token.clone(),
            });
            challenge.set_ready().await.map_err(StepError::from_acme)?;
        }
    }
    Ok(())
}

/// A challenge file the web server reads (0644 in a 0755 directory).
fn write_public(path: &Path, bytes: &[u8]) -> Result<(), StepError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let fail = |e: std::io::Error| StepError::Down(format!("cannot write {}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(fail)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(fail)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).map_err(fail)?;
    std::fs::rename(&tmp, path).map_err(fail)
}

/// Removes what an order published; what is already gone is fine.
pub async fn unpublish(ctx: &Ctx<'_>, published: &[Published]) -> Result<(), StepError> {
    for p in published {
        match p {
            Published::HttpFile { token } => {
                if let Some(path) = ctx.webroot_file(token).filter(|_| token_ok(token)) {
                    match std::fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => {
                            return Err(StepError::Down(format!(
                                "cannot remove {}: {e}",
                                path.display()
                            )))
                        }
                    }
                }
            }
            Published::DnsTxt { name, value } => {
                let name = DnsName::parse(name).map_err(StepError::Down)?;
                // A rejection means the value is not there any more.
                ctx.primary().await?.delete_txt(&name, value).await?;
            }
        }
    }
    Ok(())
}

/// Moves an order on by one step: finalize when ready, fetch the certificate when valid.
pub async fn advance(ctx: &Ctx<'_>, url: &str, request: &Request) -> Result<Step, StepError> {
    let mut order = ctx
        .account()?
        .order(url.to_owned())
        .await
        .map_err(StepError::from_acme)?;
    let waiting = |why: String| Step::Waiting {
        url: url.to_owned(),
        published: Vec::new(),
        why,
    };
    let mut status = order.state().status;
    if status == OrderStatus::Ready {
        order
            .finalize_csr(&request.csr_der)
            .await
            .map_err(StepError::from_acme)?;
        status = order.state().status;
    }
    match status {
        OrderStatus::Pending => Ok(waiting(format!(
            "order placed at {}; waiting for validation",
            ctx.ca
        ))),
        OrderStatus::Ready | OrderStatus::Processing | OrderStatus::Valid => {
            match order.certificate().await.map_err(StepError::from_acme)? {
                None => Ok(waiting(format!(
                    "order finalized at {}; waiting for the certificate",
                    ctx.ca
                ))),
                Some(pem) => issued(&pem, request).map(Step::Issued),
            }
        }
        OrderStatus::Invalid => Ok(Step::Failed {
            reason: invalid_reason(&mut order).await,
            refused: false,
        }),
    }
}

/// Why an order became invalid: its error, or the first failed challenge's.
async fn invalid_reason(order: &mut Order) -> String {
    if let Some(p) = &order.state().error {
        return format!(
            "the CA gave the order up: {}",
            p.detail.clone().unwrap_or_default()
        );
    }
    let mut authorizations = order.authorizations();
    while let Some(Ok(authz)) = authorizations.next().await {
        let name = authz.identifier().to_string();
        for c in &authz.challenges {
            if let Some(p) = &c.error {
                return format!(
                    "validation of {name} failed: {}",
                    p.detail.clone().unwrap_or_default()
                );
            }
        }
    }
    "the CA gave the order up".into()
}

/// The chain the CA sent, split into the leaf and the rest; the leaf must be for the
/// CSR's key and names.
fn issued(pem: &str, request: &Request) -> Result<Issued, StepError> {
    let bad = |why: &str| StepError::Ca {
        reason: format!("the CA's certificate {why}"),
        refused: false,
    };
    let mut blocks = Vec::new();
    for block in x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes()) {
        let block = block.map_err(|_| bad("is not PEM"))?;
        if block.label != "CERTIFICATE" {
            return Err(bad("chain holds something other than certificates"));
        }
        blocks.push(block);
    }
    let leaf = blocks.first().ok_or_else(|| bad("chain is empty"))?;
    let cert = leaf.parse_x509().map_err(|_| bad("does not parse"))?;
    use x509_parser::prelude::FromDer;
    let (_, csr) =
        x509_parser::certification_request::X509CertificationRequest::from_der(&request.csr_der)
            .map_err(|_| bad("is for a CSR that no longer parses"))?;
    if cert.public_key().raw != csr.certification_request_info.subject_pki.raw {
        return Err(bad("is not for the CSR's key"));
    }
    let encode = |b: &x509_parser::pem::Pem| {
        let body = base64_lines(&b.contents);
        format!("-----BEGIN CERTIFICATE-----\n{body}-----END CERTIFICATE-----\n")
    };
    Ok(Issued {
        csr_sha256: request.csr_sha256.clone(),
        names: request.names.clone(),
        certificate: encode(leaf),
        chain: blocks[1..].iter().map(encode).collect(),
        not_after: cert.validity().not_after.timestamp(),
    })
}

fn base64_lines(der: &[u8]) -> String {
    use base64::Engine;
    let text = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::with_capacity(text.len() + text.len() / 64 + 1);
    for chunk in text.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).expect("base64 is ASCII"));
        out.push('\n');
    }
    out
}

/// Revokes `certificate` (PEM) at the CA.
pub async fn revoke(ctx: &Ctx<'_>, certificate: &str) -> Result<(), StepError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(certificate.as_bytes())
        .map_err(|_| StepError::Down("a recorded certificate is not PEM".into()))?;
    let der = rustls::pki_types::CertificateDer::from(pem.contents);
    ctx.account()?
        .revoke(&RevocationRequest {
            certificate: &der,
            reason: None,
        })
        .await
        .map_err(StepError::from_acme)
}
