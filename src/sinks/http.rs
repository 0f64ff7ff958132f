//! HTTP plumbing shared by the sinks: the agent (timeouts, TLS roots), one POST, and how a
//! reply is judged.

use super::{Config, Outcome, Verdict};
use std::cell::Cell;
use std::io::Read;
use std::time::{Duration, Instant, SystemTime};
use ureq::tls::{PemItem, RootCerts, TlsConfig};
use ureq::unversioned::resolver::DefaultResolver;
use ureq::unversioned::transport::{
    time, Buffers, ConnectionDetails, Connector, DefaultConnector, NextTimeout, Transport,
};

/// Of a reply, at most this much is kept (Kafka REST reads its per-record results there); the
/// rest is never read: a 2xx is a delivery whatever its body.
pub const MAX_REPLY_BYTES: u64 = 8 * 1024 * 1024;

pub fn agent(config: &Config) -> Result<ureq::Agent, String> {
    let roots = match &config.tls_ca {
        Some(pem) => RootCerts::new_with_certs(&certificates(pem)?),
        None => RootCerts::WebPki,
    };
    let tls = TlsConfig::builder().root_certs(roots).build();
    let agent_config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0) // a redirected POST is a misconfigured URL: report it, do not follow
        .max_redirects_will_error(false)
        .proxy(None) // deterministic: no proxy from the postmaster's environment
        .timeout_connect(Some(config.connect_timeout))
        .timeout_global(Some(config.request_timeout))
        .max_idle_connections_per_host(config.concurrency.max(1) * 2)
        .user_agent(concat!("outbox_ext/", env!("CARGO_PKG_VERSION")))
        .tls_config(tls)
        .build();
    let connector = DefaultConnector::new().chain(WithDeadline);
    Ok(ureq::Agent::with_parts(
        agent_config,
        connector,
        DefaultResolver::default(),
    ))
}

thread_local! {
    /// When the request this thread is making must be over (see WithDeadline).
    static DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
    /// Whether the request this thread is making has written any of itself to the receiver:
    /// past the connection and the TLS handshake, which the first write of a TLS session
    /// makes (NoReply's `unreached`).
    static SENT: Cell<bool> = const { Cell::new(false) };
}

/// Ends every exchange at its deadline: ureq's own timeouts bound each wait for the socket,
/// so a peer that sends a byte every second keeps a request alive for ever. This transport
/// cuts every wait short at the deadline and fails the first one past it, on fresh and reused
/// connections alike (it wraps the socket, plain or TLS).
#[derive(Debug)]
struct WithDeadline;

impl Connector<Box<dyn Transport>> for WithDeadline {
    type Out = Deadlined;

    fn connect(
        &self,
        _: &ConnectionDetails,
        chained: Option<Box<dyn Transport>>,
    ) -> Result<Option<Deadlined>, ureq::Error> {
        Ok(chained.map(|inner| Deadlined { inner }))
    }
}

#[derive(Debug)]
struct Deadlined {
    inner: Box<dyn Transport>,
}

impl Deadlined {
    /// The wait ureq asked for, cut at the deadline; Err once it has passed.
    fn bounded(timeout: NextTimeout) -> Result<NextTimeout, ureq::Error> {
        let Some(deadline) = DEADLINE.with(Cell::get) else {
            return Ok(timeout);
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ureq::Error::Timeout(ureq::Timeout::Global));
        }
        let cut = match timeout.after {
            time::Duration::Exact(d) if d <= left => return Ok(timeout),
            _ => time::Duration::Exact(left),
        };
        Ok(NextTimeout {
            after: cut,
            reason: ureq::Timeout::Global,
        })
    }
}

impl Transport for Deadlined {
    fn buffers(&mut self) -> &mut dyn Buffers {
        self.inner.buffers()
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        let written = self.inner.transmit_output(amount, Self::bounded(timeout)?);
        if written.is_ok() {
            SENT.with(|sent| sent.set(true));
        }
        written
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        let got = self.inner.await_input(Self::bounded(timeout)?)?;
        Self::bounded(timeout)?; // past the deadline, whatever came is too late
        Ok(got)
    }

    fn is_open(&mut self) -> bool {
        self.inner.is_open()
    }

    fn is_tls(&self) -> bool {
        self.inner.is_tls() // ureq refuses an https URL over a transport that says it is not
    }
}

/// The certificates of a PEM text; fails unless there is at least one and each is an X.509
/// certificate TLS can trust (parsed as rustls parses its roots).
pub fn certificates(pem: &str) -> Result<Vec<ureq::tls::Certificate<'static>>, String> {
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(pem.as_bytes()) {
        match item {
            Ok(PemItem::Certificate(cert)) => {
                let der = rustls_pki_types::CertificateDer::from(cert.der());
                webpki::anchor_from_trusted_cert(&der).map_err(|e| {
                    format!(
                        "tls_ca: certificate {} is not valid: {e:?}",
                        certs.len() + 1
                    )
                })?;
                certs.push(cert)
            }
            Ok(_) => {}
            Err(e) => return Err(format!("tls_ca: {e}")),
        }
    }
    if certs.is_empty() {
        return Err("tls_ca holds no PEM certificate".into());
    }
    Ok(certs)
}

/// Request headers the sinks set themselves, or that frame the request: a sink's
/// http_headers may not set them.
const RESERVED_HEADERS: [&str; 9] = [
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "content-type",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "idempotency-key",
];

/// Fails unless `name: value` can be sent as a request header: the name an HTTP token
/// (RFC 9110), not one the sink sets itself; the value without control characters (CR and
/// LF would split the request) other than tab.
pub fn check_header(name: &str, value: &str) -> Result<(), String> {
    let tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(tchar) {
        return Err(format!("header name {name:?} is not an HTTP token"));
    }
    if RESERVED_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
        return Err(format!("header {name:?} is set by the sink itself"));
    }
    if value.chars().any(|c| c.is_control() && c != '\t') {
        return Err(format!(
            "the value of header {name:?} holds a control character (CR, LF, ...)"
        ));
    }
    Ok(())
}

/// A reply that came back.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub retry_after: Option<Duration>,
    pub body: String,
}

/// A request that got no reply: a transport failure (http::post).
#[derive(Debug)]
pub struct NoReply {
    pub error: String,
    /// It never reached the receiver: no address, no connection or no TLS session (nothing of
    /// it was written), so nothing the request carried can have caused it
    /// (Outcome::SinkDown's `blameable`).
    pub unreached: bool,
}

impl std::fmt::Display for NoReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.error)
    }
}

/// POSTs `body` and reads at most `keep` bytes of the reply, all within `timeout` (connect,
/// send, wait, headers and body); Err is a transport failure (connect, TLS, timeout, reset)
/// before the status came. A reply that stops or stalls after its status keeps what came.
pub fn post(
    agent: &ureq::Agent,
    url: &str,
    headers: &[(String, String)],
    body: &[u8],
    timeout: Duration,
    keep: u64,
) -> Result<Reply, NoReply> {
    DEADLINE.with(|d| d.set(Some(Instant::now() + timeout)));
    SENT.with(|sent| sent.set(false));
    let reply = exchange(agent, url, headers, body, keep);
    DEADLINE.with(|d| d.set(None));
    reply
}

fn exchange(
    agent: &ureq::Agent,
    url: &str,
    headers: &[(String, String)],
    body: &[u8],
    keep: u64,
) -> Result<Reply, NoReply> {
    let mut request = agent.post(url);
    for (name, value) in headers {
        request = request.header(name.as_str(), value.as_str());
    }
    let mut response = request.send(body).map_err(|e| NoReply {
        error: format!("{}: {e}", host_of(url)),
        unreached: !SENT.with(Cell::get),
    })?;
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, SystemTime::now()));
    let mut kept = Vec::new();
    // unlimited: the reader itself stops after `keep` bytes, and the rest is never read (the
    // connection is then closed, not reused)
    let reader = response.body_mut().with_config().limit(u64::MAX).reader();
    let read = reader.take(keep).read_to_end(&mut kept);
    let mut body = String::from_utf8_lossy(&kept).into_owned();
    if let (Err(e), false) = (read, (200..300).contains(&status)) {
        // judged by its status all the same: a 429 or a 401 cut short (a load balancer
        // resetting under load) is still throttling or a credential, never the events'
        body.push_str(&format!(" [reply cut short: {e}]"));
    }
    Ok(Reply {
        status,
        retry_after,
        body,
    })
}

/// "host:port" of a URL, for errors: outbox.status shows them to relays, so never the path or
/// credentials.
pub fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
}

/// How a reply that is not a success counts (hints: the worker blames an event only when the
/// sink is shown healthy for other events, src/worker/health.rs):
/// - throttling (429, or 503 with a Retry-After: load shed): never the events' fault,
///   whatever else the sink does: they go back unsent and the sink is slowed;
/// - a sink that is unavailable, refuses our credentials or moved (401, 403, 404, 407, 410,
///   502, 503, 504, 511, a CDN's 520-530 for an origin it cannot reach, redirects), or our
///   request's form, which no event changes (405, 411, 414, 415, 417, 421, 426, 431, 505:
///   the method, the URL, the content type, the connection, the headers): about the sink.
///   Refused credentials (401, 407, 511), the request's form (but 415 and 431) and
///   "unavailable" (503: an instance shutting down in a rolling deploy, a load balancer with
///   no instance ready) are never blamed on the events (a secret rotated on some of the
///   receiver's instances, some instances mid-deploy while the others deliver, a URL changed
///   for some); the others may be, on a sink
///   shown healthy (a 403 from a firewall that reads bodies, a 404 for an entity the event
///   names, a 415 from a receiver that could not read its body, a 431 for an event's trace
///   headers, a 502 from a receiver that crashed on it);
/// - 408, 409, 423, 425 (busy with the same event, locked, too early) and other 5xx may be
///   caused by the events, or pass: retried per key, with backoff;
/// - any other 4xx (400, 413, 422, ...) refuses the events for good, as far as the sink says
///   (`refuses_for_good`): a 413 for one event is that event too large for the receiver, or
///   the receiver's limit lowered by mistake, which the worker tells apart by whether other
///   events go through.
///
/// `n` is the number of events the request carried.
pub fn judge_failure(reply: &Reply, what: &str, n: usize) -> Outcome {
    let error = describe(reply, what);
    let retry_after = reply.retry_after;
    match reply.status {
        429 => Outcome::all(n, Verdict::Unsent { error, retry_after }),
        503 if retry_after.is_some() => Outcome::all(n, Verdict::Unsent { error, retry_after }),
        401 | 405 | 407 | 411 | 414 | 417 | 421 | 426 | 503 | 505 | 511 => Outcome::SinkDown {
            error,
            retry_after,
            blameable: false,
        },
        403 | 404 | 410 | 415 | 431 | 502 | 504 | 520..=530 | 300..=399 => Outcome::SinkDown {
            error,
            retry_after,
            blameable: true,
        },
        status if refuses_for_good(status) => Outcome::all(n, Verdict::Reject { error }),
        _ => Outcome::all(n, Verdict::Retry { error, retry_after }),
    }
}

/// A 4xx that refuses a request's events for good (judge_failure). A request of several
/// events refused so is split (sinks::split) until the events refused are alone: one event the
/// receiver will never take must not take its batch-mates, other keys' events, with it.
pub fn refuses_for_good(status: u16) -> bool {
    (400..500).contains(&status)
        && !matches!(
            status,
            401 | 403
                | 404
                | 405
                | 407
                | 408
                | 409
                | 410
                | 411
                | 414
                | 415
                | 417
                | 421
                | 423
                | 425
                | 426
                | 429
                | 431
        )
}

/// "HTTP 500 from webhook: <first 200 characters of the body>".
pub fn describe(reply: &Reply, what: &str) -> String {
    let body = super::without_nul(&reply.body.chars().take(200).collect::<String>());
    let body = body.trim();
    if body.is_empty() {
        format!("HTTP {} from {what}", reply.status)
    } else {
        format!("HTTP {} from {what}: {body}", reply.status)
    }
}

/// A receiver's Retry-After is honoured up to this: a sink suspended by it is probed again
/// after at most this long, and a key it parks waits no longer. A receiver mid-deploy that
/// answers "Retry-After: 3600" to some requests must not hold their keys back for an hour
/// while the sink delivers everything else.
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(300);

/// Retry-After is seconds or an HTTP date (RFC 9110: IMF-fixdate, or the obsolete RFC 850 and
/// asctime forms a recipient must still accept), at most RETRY_AFTER_MAX; a date already past
/// is now, and nonsense is ignored.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    let wait = match value.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => httpdate::parse_http_date(value)
            .ok()?
            .duration_since(now)
            .unwrap_or_default(),
    };
    Some(wait.min(RETRY_AFTER_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = UNIX_EPOCH + Duration::from_secs(784_111_770); // Sun, 06 Nov 1994 08:49:30 GMT
        assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("3600", now), Some(RETRY_AFTER_MAX));
        assert_eq!(
            parse_retry_after("Mon, 07 Nov 1994 08:49:30 GMT", now),
            Some(RETRY_AFTER_MAX)
        );
        // the obsolete forms RFC 9110 (5.6.7) still has recipients accept: RFC 850, asctime
        assert_eq!(
            parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            parse_retry_after("Sun Nov  6 08:49:37 1994", now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
    }

    #[test]
    fn errors_name_the_host_only() {
        assert_eq!(
            host_of("https://u:pw@hooks.example.com:8443/a/b?t=1"),
            "hooks.example.com:8443"
        );
        assert_eq!(host_of("http://127.0.0.1/"), "127.0.0.1");
    }

    #[test]
    fn failures_are_judged_by_status() {
        let reply = |status| Reply {
            status,
            retry_after: None,
            body: String::new(),
        };
        for status in [403, 404, 410, 415, 431, 502, 504, 521, 530, 301] {
            assert!(matches!(
                judge_failure(&reply(status), "x", 1),
                Outcome::SinkDown {
                    blameable: true,
                    ..
                }
            ));
        }
        // never the events': our credentials or connection settings refused, or unavailable
        for status in [401, 405, 407, 411, 414, 417, 421, 426, 503, 505, 511] {
            assert!(matches!(
                judge_failure(&reply(status), "x", 1),
                Outcome::SinkDown {
                    blameable: false,
                    ..
                }
            ));
        }
        assert!(
            matches!(judge_failure(&reply(429), "x", 1), Outcome::Events(v) if matches!(v[0], Verdict::Unsent { .. }))
        );
        let shed = Reply {
            retry_after: Some(Duration::from_secs(1)),
            ..reply(503)
        };
        assert!(
            matches!(judge_failure(&shed, "x", 1), Outcome::Events(v) if matches!(v[0], Verdict::Unsent { .. }))
        );
        for status in [408, 409, 423, 425, 500, 501] {
            assert!(
                matches!(judge_failure(&reply(status), "x", 1), Outcome::Events(v) if matches!(v[0], Verdict::Retry { .. }))
            );
        }
        for status in [400, 413, 422] {
            assert!(
                matches!(judge_failure(&reply(status), "x", 1), Outcome::Events(v) if matches!(v[0], Verdict::Reject { .. }))
            );
        }
    }

    #[test]
    fn headers_must_be_tokens_with_one_line_values() {
        assert!(check_header("Authorization", "Bearer a\tb").is_ok());
        assert!(check_header("X-Api-Key", "").is_ok());
        for bad_name in ["", "X Bad", "X-Bad:", "Ü", "a\r\nb"] {
            assert!(check_header(bad_name, "v").is_err(), "{bad_name:?}");
        }
        for bad_value in ["a\r\nX-Injected: 1", "a\nb", "a\u{0}b"] {
            assert!(check_header("X-Ok", bad_value).is_err(), "{bad_value:?}");
        }
        assert!(check_header("content-LENGTH", "1").is_err());
        assert!(check_header("Webhook-Signature", "v1,x").is_err());
    }

    #[test]
    fn a_ca_must_hold_x509_certificates() {
        assert!(certificates("no pem here").is_err());
        let garbage = "-----BEGIN CERTIFICATE-----\nAAAAAAAAAAAA\n-----END CERTIFICATE-----\n";
        assert!(certificates(garbage).is_err());
    }

    fn post_to(url: &str) -> Result<Reply, NoReply> {
        let config = crate::sinks::test_config(crate::sinks::Kind::Webhook, url);
        let agent = agent(&config).expect("an agent");
        post(&agent, url, &[], b"{}", Duration::from_secs(5), 100)
    }

    #[test]
    fn a_connection_refused_never_reached_the_receiver() {
        // a port just given up: nothing listens there
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let failure = post_to(&format!("http://127.0.0.1:{port}/")).expect_err("refused");
        assert!(failure.unreached, "{failure}");
    }

    #[test]
    fn a_host_that_does_not_resolve_never_reached_the_receiver() {
        let failure = post_to("http://outbox-ext-test.invalid/").expect_err("no address");
        assert!(failure.unreached, "{failure}");
    }

    /// A server on a free port that reads what comes on each connection, writes `reply`
    /// (nothing: it just closes) and closes; its address.
    fn answering(reply: &'static [u8]) -> std::net::SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let address = listener.local_addr().expect("bound");
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = [0u8; 4096];
                let _ = std::io::Read::read(&mut conn, &mut buf);
                let _ = std::io::Write::write_all(&mut conn, reply);
            }
        });
        address
    }

    #[test]
    fn a_connection_closed_unanswered_may_have_been_the_request() {
        // a receiver that reads the request and drops the connection: it may have crashed on it
        let failure = post_to(&format!("http://{}/", answering(b""))).expect_err("no reply");
        assert!(!failure.unreached, "{failure}");
    }

    #[test]
    fn a_tls_handshake_that_fails_never_reached_the_receiver() {
        // a plain-text server spoken to over TLS: no session, nothing of the request sent
        let address = answering(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        let failure = post_to(&format!("https://{address}/")).expect_err("no TLS session");
        assert!(failure.unreached, "{failure}");
    }
}
