//! The fixed-newstyle handshake and option haggling, up to the point where a client has chosen
//! an export (NBD_OPT_GO / NBD_OPT_EXPORT_NAME) or gone away.

use crate::capabilities::{block_size_limits, transmission_flags};
use crate::export::{Attachment, Export, ExportRegistry};
use crate::metadata::{self, MetaContext, MAX_META_CONTEXT_QUERIES, MAX_SELECTED_CONTEXTS};
use crate::protocol::*;
use crate::socket::{Socket, Transport};
use crate::Error;
use cryptblk_tls::{AllowList, CertificateNames};
use std::io::{Read, Write};
use std::sync::Arc;

/// What the options phase settled for the transmission phase.
pub(crate) struct Negotiated {
    pub transport: Transport,
    pub attachment: Attachment,
    pub structured_replies: bool,
    /// The metadata contexts the client selected for the export it went on to use; the
    /// context at index `i` has the id `i + 1`.
    pub contexts: Vec<MetaContext>,
}

/// Server-wide settings the handshake needs.
pub(crate) struct HandshakeSettings {
    pub registry: Arc<ExportRegistry>,
    /// When set, TLS is mandatory: only STARTTLS and ABORT are accepted before it.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// With TLS: the client certificate names admitted to exports without a list of their own.
    pub authz: Option<Arc<AllowList>>,
}

/// Who the client is, once TLS has verified its certificate.
struct Client<'a> {
    /// For log lines.
    peer: &'a str,
    /// The names its certificate carries (`None` before STARTTLS, or on a plain server).
    names: Option<CertificateNames>,
}

impl Client<'_> {
    /// Whether the client may see and use `export`: always on a plain server (the listener
    /// address is the boundary there); on a TLS server, when the export's allow-list (or the
    /// server's) names the client's certificate, or when there is no list. Refusals are
    /// logged, with the names the certificate carried.
    fn may_use(&self, settings: &HandshakeSettings, export: &Export, log: bool) -> bool {
        if settings.tls.is_none() {
            return true;
        }
        let Some(names) = &self.names else {
            return false;
        };
        let Some(list) = export.tls_authz.as_ref().or(settings.authz.as_deref()) else {
            return true;
        };
        let admitted = list.admits(names).is_some();
        if !admitted && log {
            tracing::warn!(
                peer = %self.peer,
                export = %export.name,
                "refusing NBD client {}: its certificate ({names}) is not on the export's \
                 tls-authz list ({list})",
                self.peer
            );
        }
        admitted
    }
}

/// Option state that STARTTLS discards: anything negotiated in plaintext could have been
/// injected by an attacker, so the spec has the client start over.
#[derive(Default)]
struct OptionState {
    structured_replies: bool,
    /// The export (resolved name) the last SET_META_CONTEXT applied to, and the contexts it
    /// selected.
    meta_context: Option<(String, Vec<MetaContext>)>,
}

/// Runs the handshake on a fresh connection. `Ok(None)` when the client aborted politely.
pub(crate) fn negotiate(
    socket: Socket,
    peer: &str,
    settings: &HandshakeSettings,
) -> Result<Option<Negotiated>, Error> {
    let mut client = Client { peer, names: None };
    let mut transport = Transport::Plain(socket);
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBD_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    transport.write_all(&greeting)?;

    let mut client_flags = [0u8; 4];
    transport.read_exact(&mut client_flags)?;
    let client_flags = u32::from_be_bytes(client_flags);
    if client_flags & !KNOWN_CLIENT_FLAGS != 0 {
        return Err(Error::Protocol(format!(
            "client sent unknown handshake flags {client_flags:#x}"
        )));
    }
    // Without fixed newstyle a client cannot cope with error replies to options; every
    // client of the last decade sets it, so refuse rather than carry a second dialect.
    if client_flags & CLIENT_FLAG_FIXED_NEWSTYLE == 0 {
        return Err(Error::Protocol(
            "client does not support fixed newstyle negotiation".into(),
        ));
    }
    let no_zeroes = client_flags & CLIENT_FLAG_NO_ZEROES != 0;

    let mut state = OptionState::default();
    loop {
        let mut header = [0u8; OPTION_HEADER_LEN];
        transport.read_exact(&mut header)?;
        let header = parse_option_header(&header).map_err(|e| Error::Protocol(e.to_string()))?;
        if header.length > MAX_OPTION_LEN {
            return Err(Error::Protocol(format!(
                "option {} has a {}-byte payload, more than the {MAX_OPTION_LEN} allowed",
                header.option, header.length
            )));
        }
        let mut data = vec![0u8; header.length as usize];
        transport.read_exact(&mut data)?;
        let option = header.option;

        let tls_pending = settings.tls.is_some() && !matches!(transport, Transport::Tls(_));
        if tls_pending && option != OPT_STARTTLS && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                // This option has no error reply; closing is the only refusal.
                return Err(Error::Protocol(
                    "NBD_OPT_EXPORT_NAME before STARTTLS on a TLS-only server".into(),
                ));
            }
            send_reply(&mut transport, option, REP_ERR_TLS_REQD, &[])?;
            continue;
        }

        match option {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8(data)
                    .map_err(|_| Error::Protocol("export name is not UTF-8".into()))?;
                let Some(attachment) = attach(settings, &client, &transport, &name)? else {
                    return Err(Error::Protocol(format!(
                        "no export named '{name}' this client may use"
                    )));
                };
                let export = attachment.export();
                let mut reply = Vec::with_capacity(10 + 124);
                reply.extend_from_slice(&export.device.size().to_be_bytes());
                reply.extend_from_slice(
                    &transmission_flags(export, state.structured_replies).to_be_bytes(),
                );
                if !no_zeroes {
                    reply.resize(reply.len() + 124, 0);
                }
                transport.write_all(&reply)?;
                transport.flush()?;
                let contexts = contexts_for(&state, export);
                return Ok(Some(Negotiated {
                    transport,
                    attachment,
                    structured_replies: state.structured_replies,
                    contexts,
                }));
            }
            OPT_ABORT => {
                // The client may already have closed; a failed ACK changes nothing.
                let _ = send_reply(&mut transport, option, REP_ACK, &[]);
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    send_reply(&mut transport, option, REP_ERR_INVALID, &[])?;
                    continue;
                }
                for export in settings.registry.list() {
                    if !client.may_use(settings, &export, false) {
                        continue;
                    }
                    let mut payload = Vec::with_capacity(4 + export.name.len());
                    payload.extend_from_slice(&(export.name.len() as u32).to_be_bytes());
                    payload.extend_from_slice(export.name.as_bytes());
                    payload.extend_from_slice(export.description.as_bytes());
                    send_reply(&mut transport, option, REP_SERVER, &payload)?;
                }
                send_reply(&mut transport, option, REP_ACK, &[])?;
            }
            OPT_STARTTLS => {
                let Some(config) = &settings.tls else {
                    send_reply(&mut transport, option, REP_ERR_UNSUP, &[])?;
                    continue;
                };
                if matches!(transport, Transport::Tls(_)) || !data.is_empty() {
                    send_reply(&mut transport, option, REP_ERR_INVALID, &[])?;
                    continue;
                }
                send_reply(&mut transport, option, REP_ACK, &[])?;
                let (tls, names) = start_tls(transport, config, peer)?;
                transport = tls;
                if !admitted_somewhere(settings, &names) {
                    tracing::warn!(
                        peer = %peer,
                        "refusing NBD client {peer}: its certificate ({names}) is on no \
                         tls-authz list"
                    );
                    return Err(Error::Protocol(format!(
                        "client certificate ({names}) is not on the tls-authz list"
                    )));
                }
                client.names = Some(names);
                state = OptionState::default();
            }
            OPT_INFO | OPT_GO => {
                let Some(request) = parse_info_request(&data) else {
                    send_reply(&mut transport, option, REP_ERR_INVALID, &[])?;
                    continue;
                };
                let Some(export) = settings.registry.lookup(&request.name) else {
                    send_reply(&mut transport, option, REP_ERR_UNKNOWN, &[])?;
                    continue;
                };
                if !client.may_use(settings, &export, true) {
                    send_reply(&mut transport, option, REP_ERR_POLICY, &[])?;
                    continue;
                }
                if option == OPT_INFO {
                    send_export_info(&mut transport, option, &export, &state)?;
                    continue;
                }
                let Some(attachment) = attach(settings, &client, &transport, &request.name)? else {
                    send_reply(&mut transport, option, REP_ERR_UNKNOWN, &[])?;
                    continue;
                };
                send_export_info(&mut transport, option, attachment.export(), &state)?;
                let contexts = contexts_for(&state, attachment.export());
                return Ok(Some(Negotiated {
                    transport,
                    attachment,
                    structured_replies: state.structured_replies,
                    contexts,
                }));
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    send_reply(&mut transport, option, REP_ERR_INVALID, &[])?;
                    continue;
                }
                state.structured_replies = true;
                send_reply(&mut transport, option, REP_ACK, &[])?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                handle_meta_context(&mut transport, settings, &client, &mut state, option, &data)?;
            }
            _ => send_reply(&mut transport, option, REP_ERR_UNSUP, &[])?,
        }
    }
}

/// Whether a client with the certificate `names` may use any export: refused right after the
/// TLS handshake otherwise, before it learns anything.
fn admitted_somewhere(settings: &HandshakeSettings, names: &CertificateNames) -> bool {
    let Some(list) = &settings.authz else {
        return true;
    };
    list.admits(names).is_some()
        || settings.registry.list().iter().any(|export| {
            export
                .tls_authz
                .as_ref()
                .is_some_and(|l| l.admits(names).is_some())
        })
}

/// Registers the connection with the export, giving the registry a socket handle with which
/// `remove` can stop the connection. `None` when there is no such export or the client may
/// not use it (refusal logged).
fn attach(
    settings: &HandshakeSettings,
    client: &Client<'_>,
    transport: &Transport,
    name: &str,
) -> Result<Option<Attachment>, Error> {
    let socket = transport.socket().try_clone()?;
    let attachment = settings.registry.attach(name, socket);
    Ok(attachment.filter(|a| client.may_use(settings, a.export(), true)))
}

/// The contexts the last SET_META_CONTEXT selected, if it was for the export now chosen (a
/// selection made for another export does not carry over).
fn contexts_for(state: &OptionState, export: &Export) -> Vec<MetaContext> {
    match &state.meta_context {
        Some((name, contexts)) if state.structured_replies && *name == export.name => {
            contexts.clone()
        }
        _ => Vec::new(),
    }
}

fn send_reply(
    transport: &mut Transport,
    option: u32,
    reply_type: u32,
    payload: &[u8],
) -> Result<(), Error> {
    // Payloads are built by this module and bounded by MAX_OPTION_LEN-sized inputs.
    let len = u32::try_from(payload.len())
        .map_err(|_| Error::Protocol("option reply too large".into()))?;
    let mut message = Vec::with_capacity(20 + payload.len());
    message.extend_from_slice(&encode_option_reply_header(option, reply_type, len));
    message.extend_from_slice(payload);
    transport.write_all(&message)?;
    transport.flush()?;
    Ok(())
}

/// Sends every NBD_INFO item whether or not it was requested (the spec allows unrequested
/// items) and ends with NBD_REP_ACK. Block sizes are always sent because a 4096-byte-sector
/// volume cannot serve smaller requests; a client that did not ask still learns the limit.
fn send_export_info(
    transport: &mut Transport,
    option: u32,
    export: &Export,
    state: &OptionState,
) -> Result<(), Error> {
    let (minimum, preferred, maximum) = block_size_limits(export);
    let infos = [
        encode_info_export(
            export.device.size(),
            transmission_flags(export, state.structured_replies),
        ),
        encode_info_string(INFO_NAME, &export.name),
        encode_info_string(INFO_DESCRIPTION, &export.description),
        encode_info_block_size(minimum, preferred, maximum),
    ];
    for info in infos {
        send_reply(transport, option, REP_INFO, &info)?;
    }
    send_reply(transport, option, REP_ACK, &[])
}

fn handle_meta_context(
    transport: &mut Transport,
    settings: &HandshakeSettings,
    client: &Client<'_>,
    state: &mut OptionState,
    option: u32,
    data: &[u8],
) -> Result<(), Error> {
    // A SET that fails leaves nothing selected (the spec's rule for the client too).
    if option == OPT_SET_META_CONTEXT {
        state.meta_context = None;
    }
    // Metadata is only ever returned in structured replies; the spec has the server refuse
    // these options until they are negotiated.
    if !state.structured_replies {
        return send_reply(transport, option, REP_ERR_INVALID, &[]);
    }
    let Some(request) = parse_meta_context_request(data) else {
        return send_reply(transport, option, REP_ERR_INVALID, &[]);
    };
    let Some(export) = settings.registry.lookup(&request.export_name) else {
        return send_reply(transport, option, REP_ERR_UNKNOWN, &[]);
    };
    if !client.may_use(settings, &export, true) {
        return send_reply(transport, option, REP_ERR_POLICY, &[]);
    }
    if request.queries.len() > MAX_META_CONTEXT_QUERIES {
        tracing::warn!(
            peer = %client.peer,
            "NBD client {} sent {} metadata context queries, more than the \
             {MAX_META_CONTEXT_QUERIES} allowed",
            client.peer,
            request.queries.len()
        );
        return send_reply(transport, option, REP_ERR_TOO_BIG, &[]);
    }
    let listing = option == OPT_LIST_META_CONTEXT;
    let selected = metadata::select(export.dirty_bitmaps.as_deref(), &request.queries, listing);
    if !listing && selected.len() > MAX_SELECTED_CONTEXTS {
        return send_reply(transport, option, REP_ERR_TOO_BIG, &[]);
    }
    for (index, context) in selected.iter().enumerate() {
        let name = context.name();
        // Ids only mean something for SET; the spec has LIST send zero.
        let id = if listing { 0 } else { index as u32 + 1 };
        let mut payload = Vec::with_capacity(4 + name.len());
        payload.extend_from_slice(&id.to_be_bytes());
        payload.extend_from_slice(name.as_bytes());
        send_reply(transport, option, REP_META_CONTEXT, &payload)?;
    }
    if !listing {
        state.meta_context = Some((export.name.clone(), selected));
    }
    send_reply(transport, option, REP_ACK, &[])
}

/// Runs the TLS handshake; the client must present a certificate the CA signed (rustls
/// refuses it otherwise). Returns the names on that certificate.
fn start_tls(
    transport: Transport,
    config: &Arc<rustls::ServerConfig>,
    peer: &str,
) -> Result<(Transport, CertificateNames), Error> {
    let Transport::Plain(mut socket) = transport else {
        return Err(Error::Protocol("STARTTLS on a TLS connection".into()));
    };
    let mut connection = rustls::ServerConnection::new(Arc::clone(config))?;
    // Bounded by the socket's I/O timeout, like the rest of the handshake.
    let peer_label = format!("NBD client {peer}");
    cryptblk_net::tls::complete_handshake(&mut connection, &mut socket, &peer_label).map_err(
        |e| {
            // A client without a certificate, or with one the CA did not sign, ends here.
            tracing::warn!(peer = %peer, "refusing NBD client {peer}: {e}");
            match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    Error::Protocol("client closed during the TLS handshake".into())
                }
                _ => Error::Io(e),
            }
        },
    )?;
    let names = connection
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(|leaf| cryptblk_tls::certificate_names(leaf))
        .ok_or_else(|| Error::Protocol("the client's certificate cannot be read".into()))?;
    Ok((
        Transport::Tls(Box::new(rustls::StreamOwned::new(connection, socket))),
        names,
    ))
}
