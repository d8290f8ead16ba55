//! The NBD wire format: magic numbers, flags, option, reply, command and error codes, and the
//! encoders and decoders of every message Ferrite sends or receives.
//!
//! Every integer on the wire is big-endian (network byte order). Encoders append to a
//! caller-provided `Vec<u8>` and allocate nothing else; decoders take fixed-size arrays, so a
//! short input cannot reach them, and report a bad magic as an error rather than panicking.
//! Both directions are here (the server's and the client's) so that test clients and the
//! benchmark speak the protocol through this module and write no byte layout of their own.
//!
//! Layouts (see `docs/nbd.md` for the full description):
//!
//! ```text
//! greeting       "NBDMAGIC" u64 | "IHAVEOPT" u64 | handshake flags u16          (18 bytes)
//! option         "IHAVEOPT" u64 | option u32 | length u32 | data               (16 + length)
//! option reply   0x3e889045565a9 u64 | option u32 | type u32 | length u32 | data (20 + length)
//! request        0x25609513 u32 | flags u16 | type u16 | cookie u64 | offset u64 | length u32
//!                                                             (28 bytes, then data for WRITE)
//! simple reply   0x67446698 u32 | error u32 | cookie u64                    (16, then data)
//! chunk          0x668e33ef u32 | flags u16 | type u16 | cookie u64 | length u32
//!                                                             (20 bytes, then payload)
//! ```

/// "NBDMAGIC": the first eight bytes a server sends.
pub const INIT_PASSWD: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": the newstyle magic, in the greeting and at the start of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply (fixed newstyle).
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of every transmission request (compact headers).
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of the request of the extended-headers extension, which Ferrite does not negotiate.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Size of the server greeting: two magics and the handshake flags.
pub const GREETING_BYTES: usize = 18;
/// Size of the client flags that answer the greeting.
pub const CLIENT_FLAGS_BYTES: usize = 4;
/// Size of an option header: magic, option, length.
pub const OPTION_HEADER_BYTES: usize = 16;
/// Size of an option reply header: magic, option, reply type, length.
pub const OPTION_REPLY_HEADER_BYTES: usize = 20;
/// Size of the answer to NBD_OPT_EXPORT_NAME without its zero padding: size and flags.
pub const EXPORT_NAME_REPLY_BYTES: usize = 10;
/// Zero padding after the NBD_OPT_EXPORT_NAME answer unless NBD_FLAG_C_NO_ZEROES was set.
pub const EXPORT_NAME_ZEROES_BYTES: usize = 124;
/// Size of a request header (compact form).
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Size of a structured reply chunk header.
pub const CHUNK_HEADER_BYTES: usize = 20;
/// Payload bytes of an NBD_REPLY_TYPE_OFFSET_DATA chunk before its data: the offset.
pub const OFFSET_DATA_PREFIX_BYTES: usize = 8;
/// Payload bytes of an NBD_REPLY_TYPE_ERROR chunk before its message: error and message length.
pub const ERROR_CHUNK_PREFIX_BYTES: usize = 6;
/// The longest string (export name, description, error message) the protocol allows.
pub const STRING_BYTES_MAX: usize = 4096;

/// Handshake flags (16 bits), sent by the server in the greeting.
pub mod handshake_flag {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// Client flags (32 bits), the client's answer to the greeting.
pub mod client_flag {
    pub const C_FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const C_NO_ZEROES: u32 = 1 << 1;
    /// Every flag a client may set; anything else closes the connection.
    pub const KNOWN: u32 = C_FIXED_NEWSTYLE | C_NO_ZEROES;
}

/// Transmission flags (16 bits), per export.
pub mod transmission_flag {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_RESIZE: u16 = 1 << 9;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
    pub const BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;
}

/// Option codes sent by the client during option haggling.
pub mod option {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const PEEK_EXPORT: u32 = 4;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types; errors have bit 31 set.
pub mod reply_type {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    pub const ERROR_BIT: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = ERROR_BIT | 1;
    pub const ERR_POLICY: u32 = ERROR_BIT | 2;
    pub const ERR_INVALID: u32 = ERROR_BIT | 3;
    pub const ERR_PLATFORM: u32 = ERROR_BIT | 4;
    pub const ERR_TLS_REQD: u32 = ERROR_BIT | 5;
    pub const ERR_UNKNOWN: u32 = ERROR_BIT | 6;
    pub const ERR_SHUTDOWN: u32 = ERROR_BIT | 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERROR_BIT | 8;
    pub const ERR_TOO_BIG: u32 = ERROR_BIT | 9;
    pub const ERR_EXT_HEADER_REQD: u32 = ERROR_BIT | 10;
}

/// Information types inside NBD_REP_INFO replies (and requested by NBD_OPT_INFO / NBD_OPT_GO).
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
    /// Payload of NBD_INFO_EXPORT after its type: size u64, transmission flags u16.
    pub const EXPORT_BYTES: usize = 2 + 8 + 2;
    /// Payload of NBD_INFO_BLOCK_SIZE after its type: minimum, preferred, maximum (u32 each).
    pub const BLOCK_SIZE_BYTES: usize = 2 + 4 + 4 + 4;
}

/// Request (command) types.
pub mod command {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
    pub const RESIZE: u16 = 8;
}

/// Command flags (16 bits) in a request.
pub mod command_flag {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Structured reply chunk flags.
pub mod chunk_flag {
    pub const DONE: u16 = 1 << 0;
}

/// Structured reply chunk types; error types have bit 15 set.
pub mod chunk_type {
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const OFFSET_HOLE: u16 = 2;
    pub const BLOCK_STATUS: u16 = 5;
    pub const ERROR_BIT: u16 = 1 << 15;
    pub const ERROR: u16 = ERROR_BIT | 1;
    pub const ERROR_OFFSET: u16 = ERROR_BIT | 2;
}

/// The error values a reply may carry. The protocol fixes these numbers (they are the common
/// Linux errno values); the client sees them as the errno of its failed I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Errno {
    #[error("operation not permitted (EPERM)")]
    Perm,
    #[error("input/output error (EIO)")]
    Io,
    #[error("cannot allocate memory (ENOMEM)")]
    NoMem,
    #[error("invalid argument (EINVAL)")]
    Invalid,
    #[error("no space left on device (ENOSPC)")]
    NoSpace,
    #[error("value too large (EOVERFLOW)")]
    Overflow,
    #[error("operation not supported (ENOTSUP)")]
    NotSupported,
    #[error("server is shutting down (ESHUTDOWN)")]
    Shutdown,
}

impl Errno {
    /// The value on the wire.
    pub const fn code(self) -> u32 {
        match self {
            Errno::Perm => 1,
            Errno::Io => 5,
            Errno::NoMem => 12,
            Errno::Invalid => 22,
            Errno::NoSpace => 28,
            Errno::Overflow => 75,
            Errno::NotSupported => 95,
            Errno::Shutdown => 108,
        }
    }

    /// The error of a wire value; unknown nonzero values read as EINVAL, as the protocol tells
    /// clients to treat them. Zero is success: None.
    pub const fn from_code(code: u32) -> Option<Errno> {
        Some(match code {
            0 => return None,
            1 => Errno::Perm,
            5 => Errno::Io,
            12 => Errno::NoMem,
            28 => Errno::NoSpace,
            75 => Errno::Overflow,
            95 => Errno::NotSupported,
            108 => Errno::Shutdown,
            _ => Errno::Invalid,
        })
    }
}

fn be_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_be_bytes(word)
}

fn be_u64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(word)
}

/// A big-endian u16 at `at`, or None if `bytes` is too short. For variable-length payloads.
pub fn read_u16(bytes: &[u8], at: usize) -> Option<u16> {
    let end = at.checked_add(2)?;
    (end <= bytes.len()).then(|| be_u16(bytes, at))
}

/// A big-endian u32 at `at`, or None if `bytes` is too short. For variable-length payloads.
pub fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let end = at.checked_add(4)?;
    (end <= bytes.len()).then(|| be_u32(bytes, at))
}

/// A big-endian u64 at `at`, or None if `bytes` is too short. For variable-length payloads.
pub fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let end = at.checked_add(8)?;
    (end <= bytes.len()).then(|| be_u64(bytes, at))
}

/// A fixed-size message started with the wrong magic number; the stream cannot be resynchronised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("bad magic {found:#x}, expected {expected:#x}")]
pub struct BadMagic {
    pub found: u64,
    pub expected: u64,
}

fn check_magic(found: u64, expected: u64) -> Result<(), BadMagic> {
    if found == expected {
        Ok(())
    } else {
        Err(BadMagic { found, expected })
    }
}

/// Appends the server greeting (fixed newstyle).
pub fn encode_greeting(out: &mut Vec<u8>, handshake_flags: u16) {
    out.extend_from_slice(&INIT_PASSWD.to_be_bytes());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&handshake_flags.to_be_bytes());
}

/// Decodes the greeting: the handshake flags.
pub fn decode_greeting(bytes: &[u8; GREETING_BYTES]) -> Result<u16, BadMagic> {
    check_magic(be_u64(bytes, 0), INIT_PASSWD)?;
    check_magic(be_u64(bytes, 8), IHAVEOPT)?;
    Ok(be_u16(bytes, 16))
}

/// The header of an option sent by the client; `length` bytes of data follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

impl OptionHeader {
    pub fn decode(bytes: &[u8; OPTION_HEADER_BYTES]) -> Result<OptionHeader, BadMagic> {
        check_magic(be_u64(bytes, 0), IHAVEOPT)?;
        Ok(OptionHeader { option: be_u32(bytes, 8), length: be_u32(bytes, 12) })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&self.option.to_be_bytes());
        out.extend_from_slice(&self.length.to_be_bytes());
    }
}

/// The header of an option reply; `length` bytes of data follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub length: u32,
}

impl OptionReplyHeader {
    pub fn decode(bytes: &[u8; OPTION_REPLY_HEADER_BYTES]) -> Result<OptionReplyHeader, BadMagic> {
        check_magic(be_u64(bytes, 0), OPTION_REPLY_MAGIC)?;
        Ok(OptionReplyHeader {
            option: be_u32(bytes, 8),
            reply_type: be_u32(bytes, 12),
            length: be_u32(bytes, 16),
        })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.option.to_be_bytes());
        out.extend_from_slice(&self.reply_type.to_be_bytes());
        out.extend_from_slice(&self.length.to_be_bytes());
    }
}

/// Appends a whole option reply with `payload` as its data.
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, payload: &[u8]) {
    let length = u32::try_from(payload.len()).expect("option reply payloads are small");
    OptionReplyHeader { option, reply_type, length }.encode(out);
    out.extend_from_slice(payload);
}

/// Appends an NBD_REP_SERVER reply for NBD_OPT_LIST: the name's length, the name, then the
/// description (free text for people).
pub fn encode_rep_server(out: &mut Vec<u8>, name: &str, description: &str) {
    assert!(name.len() <= STRING_BYTES_MAX && description.len() <= STRING_BYTES_MAX);
    let length = 4 + name.len() + description.len();
    OptionReplyHeader {
        option: option::LIST,
        reply_type: reply_type::SERVER,
        length: length as u32,
    }
    .encode(out);
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(description.as_bytes());
}

/// Appends an NBD_REP_INFO reply carrying NBD_INFO_EXPORT: size and transmission flags.
pub fn encode_info_export(out: &mut Vec<u8>, option: u32, size_bytes: u64, flags: u16) {
    let header = OptionReplyHeader {
        option,
        reply_type: reply_type::INFO,
        length: info::EXPORT_BYTES as u32,
    };
    header.encode(out);
    out.extend_from_slice(&info::EXPORT.to_be_bytes());
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
}

/// Appends an NBD_REP_INFO reply carrying NBD_INFO_NAME or NBD_INFO_DESCRIPTION.
pub fn encode_info_text(out: &mut Vec<u8>, option: u32, info_type: u16, text: &str) {
    assert!(info_type == info::NAME || info_type == info::DESCRIPTION);
    assert!(text.len() <= STRING_BYTES_MAX);
    let header =
        OptionReplyHeader { option, reply_type: reply_type::INFO, length: 2 + text.len() as u32 };
    header.encode(out);
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// The size constraints of an export (NBD_INFO_BLOCK_SIZE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub minimum_bytes: u32,
    pub preferred_bytes: u32,
    pub maximum_payload_bytes: u32,
}

/// Appends an NBD_REP_INFO reply carrying NBD_INFO_BLOCK_SIZE.
pub fn encode_info_block_size(out: &mut Vec<u8>, option: u32, sizes: BlockSizes) {
    let header = OptionReplyHeader {
        option,
        reply_type: reply_type::INFO,
        length: info::BLOCK_SIZE_BYTES as u32,
    };
    header.encode(out);
    out.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&sizes.minimum_bytes.to_be_bytes());
    out.extend_from_slice(&sizes.preferred_bytes.to_be_bytes());
    out.extend_from_slice(&sizes.maximum_payload_bytes.to_be_bytes());
}

/// Appends the answer to NBD_OPT_EXPORT_NAME: size, transmission flags and, unless the client
/// set NBD_FLAG_C_NO_ZEROES, 124 zero bytes.
pub fn encode_export_name_reply(out: &mut Vec<u8>, size_bytes: u64, flags: u16, zeroes: bool) {
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    if zeroes {
        out.extend_from_slice(&[0; EXPORT_NAME_ZEROES_BYTES]);
    }
}

/// A transmission request header (compact form). `length` bytes of data follow a WRITE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    /// Opaque to the server; echoed in the reply. Earlier spec versions called it a handle.
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    pub fn decode(bytes: &[u8; REQUEST_HEADER_BYTES]) -> Result<RequestHeader, BadMagic> {
        check_magic(u64::from(be_u32(bytes, 0)), u64::from(REQUEST_MAGIC))?;
        Ok(RequestHeader {
            flags: be_u16(bytes, 4),
            command: be_u16(bytes, 6),
            cookie: be_u64(bytes, 8),
            offset: be_u64(bytes, 16),
            length: be_u32(bytes, 24),
        })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.command.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.offset.to_be_bytes());
        out.extend_from_slice(&self.length.to_be_bytes());
    }
}

/// A simple reply header; the data of a successful READ follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    /// Zero for success, else an [`Errno`] code.
    pub error: u32,
    pub cookie: u64,
}

impl SimpleReply {
    pub fn decode(bytes: &[u8; SIMPLE_REPLY_BYTES]) -> Result<SimpleReply, BadMagic> {
        check_magic(u64::from(be_u32(bytes, 0)), u64::from(SIMPLE_REPLY_MAGIC))?;
        Ok(SimpleReply { error: be_u32(bytes, 4), cookie: be_u64(bytes, 8) })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.error.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
    }
}

/// A structured reply chunk header; `length` bytes of payload follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub chunk_type: u16,
    pub cookie: u64,
    pub length: u32,
}

impl ChunkHeader {
    pub fn decode(bytes: &[u8; CHUNK_HEADER_BYTES]) -> Result<ChunkHeader, BadMagic> {
        check_magic(u64::from(be_u32(bytes, 0)), u64::from(STRUCTURED_REPLY_MAGIC))?;
        Ok(ChunkHeader {
            flags: be_u16(bytes, 4),
            chunk_type: be_u16(bytes, 6),
            cookie: be_u64(bytes, 8),
            length: be_u32(bytes, 16),
        })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.chunk_type.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.length.to_be_bytes());
    }
}

/// Appends an NBD_REPLY_TYPE_OFFSET_DATA chunk header and its offset; the caller appends
/// `data_length` bytes of data.
pub fn encode_offset_data_header(
    out: &mut Vec<u8>,
    flags: u16,
    cookie: u64,
    offset: u64,
    data_length: u32,
) {
    assert!(data_length > 0, "an OFFSET_DATA chunk carries at least one byte");
    let length = data_length
        .checked_add(OFFSET_DATA_PREFIX_BYTES as u32)
        .expect("OFFSET_DATA chunk length fits in 32 bits");
    ChunkHeader { flags, chunk_type: chunk_type::OFFSET_DATA, cookie, length }.encode(out);
    out.extend_from_slice(&offset.to_be_bytes());
}

/// Appends an NBD_REPLY_TYPE_ERROR chunk: the error, then a message for people (cut at
/// [`STRING_BYTES_MAX`] bytes on a character boundary).
pub fn encode_error_chunk(out: &mut Vec<u8>, flags: u16, cookie: u64, error: Errno, message: &str) {
    let message = truncate_str(message, STRING_BYTES_MAX);
    let length = (ERROR_CHUNK_PREFIX_BYTES + message.len()) as u32;
    ChunkHeader { flags, chunk_type: chunk_type::ERROR, cookie, length }.encode(out);
    out.extend_from_slice(&error.code().to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
}

/// Appends an NBD_REPLY_TYPE_NONE chunk with NBD_REPLY_FLAG_DONE: success without payload.
pub fn encode_none_chunk(out: &mut Vec<u8>, cookie: u64) {
    ChunkHeader { flags: chunk_flag::DONE, chunk_type: chunk_type::NONE, cookie, length: 0 }
        .encode(out);
}

/// The longest prefix of `text` of at most `bytes_max` bytes that ends on a character boundary.
pub fn truncate_str(text: &str, bytes_max: usize) -> &str {
    if text.len() <= bytes_max {
        return text;
    }
    let mut end = bytes_max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_layout() {
        let mut out = Vec::new();
        encode_greeting(&mut out, handshake_flag::FIXED_NEWSTYLE | handshake_flag::NO_ZEROES);
        assert_eq!(out.len(), GREETING_BYTES);
        assert_eq!(&out[..8], b"NBDMAGIC");
        assert_eq!(&out[8..16], b"IHAVEOPT");
        assert_eq!(&out[16..], &[0, 3]);
        let bytes: [u8; GREETING_BYTES] = out.try_into().unwrap();
        assert_eq!(decode_greeting(&bytes), Ok(3));
    }

    #[test]
    fn option_header_round_trip_and_magic() {
        let mut out = Vec::new();
        OptionHeader { option: option::GO, length: 0x0102_0304 }.encode(&mut out);
        assert_eq!(out.len(), OPTION_HEADER_BYTES);
        assert_eq!(&out[8..], &[0, 0, 0, 7, 1, 2, 3, 4]);
        let mut bytes: [u8; OPTION_HEADER_BYTES] = out.try_into().unwrap();
        assert_eq!(
            OptionHeader::decode(&bytes),
            Ok(OptionHeader { option: option::GO, length: 0x0102_0304 })
        );
        bytes[0] ^= 1;
        assert!(OptionHeader::decode(&bytes).is_err());
    }

    #[test]
    fn option_reply_layout() {
        let mut out = Vec::new();
        encode_option_reply(&mut out, option::LIST, reply_type::ERR_UNSUP, b"no");
        assert_eq!(
            out,
            [
                0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // magic 0x3e889045565a9
                0, 0, 0, 3, // option
                0x80, 0, 0, 1, // NBD_REP_ERR_UNSUP
                0, 0, 0, 2, // length
                b'n', b'o',
            ]
        );
        let header: [u8; OPTION_REPLY_HEADER_BYTES] = out[..20].try_into().unwrap();
        let decoded = OptionReplyHeader::decode(&header).unwrap();
        assert_eq!(decoded.reply_type, reply_type::ERR_UNSUP);
        assert_eq!(decoded.length, 2);
    }

    #[test]
    fn info_layouts() {
        let mut out = Vec::new();
        encode_info_export(&mut out, option::GO, 0x1_0000_0000, 0x0143);
        assert_eq!(out.len(), OPTION_REPLY_HEADER_BYTES + 12);
        assert_eq!(&out[16..20], &[0, 0, 0, 12]);
        assert_eq!(&out[20..], &[0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0x01, 0x43]);
        out.clear();
        let sizes = BlockSizes {
            minimum_bytes: 4096,
            preferred_bytes: 4096,
            maximum_payload_bytes: 1 << 25,
        };
        encode_info_block_size(&mut out, option::INFO, sizes);
        assert_eq!(&out[16..20], &[0, 0, 0, 14]);
        assert_eq!(&out[20..], &[0, 3, 0, 0, 0x10, 0, 0, 0, 0x10, 0, 2, 0, 0, 0]);
        out.clear();
        encode_info_text(&mut out, option::GO, info::NAME, "vol");
        assert_eq!(&out[16..], &[0, 0, 0, 5, 0, 1, b'v', b'o', b'l']);
        out.clear();
        encode_rep_server(&mut out, "a", "bc");
        assert_eq!(&out[12..], &[0, 0, 0, 2, 0, 0, 0, 7, 0, 0, 0, 1, b'a', b'b', b'c']);
    }

    #[test]
    fn export_name_reply_with_and_without_zeroes() {
        let mut out = Vec::new();
        encode_export_name_reply(&mut out, 4096, 0x0001, true);
        assert_eq!(out.len(), EXPORT_NAME_REPLY_BYTES + EXPORT_NAME_ZEROES_BYTES);
        out.clear();
        encode_export_name_reply(&mut out, 4096, 0x0001, false);
        assert_eq!(out, [0, 0, 0, 0, 0, 0, 0x10, 0, 0, 1]);
    }

    #[test]
    fn request_header_round_trip_and_magic() {
        let header = RequestHeader {
            flags: command_flag::FUA,
            command: command::WRITE,
            cookie: 0x1122_3344_5566_7788,
            offset: 0x0000_0001_0000_0000,
            length: 8192,
        };
        let mut out = Vec::new();
        header.encode(&mut out);
        assert_eq!(
            out,
            [
                0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,
                0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0x20, 0
            ]
        );
        let mut bytes: [u8; REQUEST_HEADER_BYTES] = out.try_into().unwrap();
        assert_eq!(RequestHeader::decode(&bytes), Ok(header));
        bytes[..4].copy_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        assert_eq!(
            RequestHeader::decode(&bytes),
            Err(BadMagic { found: 0x21e4_1c71, expected: 0x2560_9513 })
        );
    }

    #[test]
    fn reply_layouts() {
        let mut out = Vec::new();
        SimpleReply { error: 22, cookie: 9 }.encode(&mut out);
        assert_eq!(out, [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0, 9]);
        let bytes: [u8; SIMPLE_REPLY_BYTES] = out.as_slice().try_into().unwrap();
        assert_eq!(SimpleReply::decode(&bytes), Ok(SimpleReply { error: 22, cookie: 9 }));
        out.clear();
        encode_offset_data_header(&mut out, chunk_flag::DONE, 9, 4096, 4096);
        assert_eq!(
            out,
            [
                0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0x10, 8, 0, 0, 0,
                0, 0, 0, 0x10, 0
            ]
        );
        out.clear();
        encode_error_chunk(&mut out, chunk_flag::DONE, 9, Errno::NoSpace, "full");
        assert_eq!(&out[4..8], &[0, 1, 0x80, 1]);
        assert_eq!(&out[16..], &[0, 0, 0, 10, 0, 0, 0, 28, 0, 4, b'f', b'u', b'l', b'l']);
        out.clear();
        encode_none_chunk(&mut out, 9);
        let bytes: [u8; CHUNK_HEADER_BYTES] = out.as_slice().try_into().unwrap();
        assert_eq!(
            ChunkHeader::decode(&bytes),
            Ok(ChunkHeader { flags: 1, chunk_type: chunk_type::NONE, cookie: 9, length: 0 })
        );
    }

    #[test]
    fn error_chunk_message_is_bounded() {
        let mut out = Vec::new();
        let long = "é".repeat(STRING_BYTES_MAX);
        encode_error_chunk(&mut out, chunk_flag::DONE, 1, Errno::Io, &long);
        let message_length = u16::from_be_bytes([out[24], out[25]]) as usize;
        assert!(message_length <= STRING_BYTES_MAX);
        assert!(std::str::from_utf8(&out[26..]).is_ok());
        assert_eq!(out.len(), CHUNK_HEADER_BYTES + ERROR_CHUNK_PREFIX_BYTES + message_length);
    }

    #[test]
    fn errno_codes_round_trip() {
        for errno in [
            Errno::Perm,
            Errno::Io,
            Errno::NoMem,
            Errno::Invalid,
            Errno::NoSpace,
            Errno::Overflow,
            Errno::NotSupported,
            Errno::Shutdown,
        ] {
            assert_eq!(Errno::from_code(errno.code()), Some(errno));
        }
        assert_eq!(Errno::from_code(0), None);
        assert_eq!(Errno::from_code(4242), Some(Errno::Invalid));
    }

    #[test]
    fn readers_refuse_short_input() {
        assert_eq!(read_u16(&[1], 0), None);
        assert_eq!(read_u32(&[0, 0, 0, 5], 0), Some(5));
        assert_eq!(read_u32(&[0, 0, 0, 5], 1), None);
        assert_eq!(read_u64(&[0; 8], usize::MAX), None);
    }
}
