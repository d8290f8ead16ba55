//! Fuzzes `nvmf::pdu::decode` with arbitrary bytes under both roles, every digest setting and
//! any data alignment: the decoder must never panic, never claim more bytes than it was given,
//! and never ask for more than the largest PDU it accepts. A decoded PDU must re-encode.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvmf::pdu::{self, Decoded, Framing, Pdu, Role, COMMON_HEADER_BYTES};

/// PDUs decoded from one input at most: each takes at least a common header, so this only
/// bounds pathological inputs.
const PDUS_PER_INPUT_MAX: usize = 4096;

fuzz_target!(|input: &[u8]| {
    let Some((&settings, bytes)) = input.split_first() else { return };
    let Some((&size_byte, bytes)) = bytes.split_first() else { return };
    let framing = Framing {
        role: if settings & 1 == 0 { Role::Controller } else { Role::Host },
        header_digest: settings & 2 != 0,
        data_digest: settings & 4 != 0,
        receive_pda: (settings >> 3) & 0x3,
        send_pda: settings >> 5,
        pdu_size_max: 128 + u32::from(size_byte) * 512,
    };
    let mut offset = 0;
    for _ in 0..PDUS_PER_INPUT_MAX {
        let rest = &bytes[offset..];
        match pdu::decode(rest, &framing) {
            Ok(Decoded::Incomplete { needed_bytes }) => {
                assert!(needed_bytes > rest.len());
                assert!(needed_bytes <= framing.pdu_size_max as usize);
                return;
            }
            Ok(Decoded::Pdu { pdu, consumed_bytes }) => {
                assert!(consumed_bytes >= COMMON_HEADER_BYTES && consumed_bytes <= rest.len());
                reencode(&pdu, &framing);
                offset += consumed_bytes;
            }
            Ok(Decoded::DataDigestMismatch { consumed_bytes, .. }) => {
                assert!(consumed_bytes >= COMMON_HEADER_BYTES && consumed_bytes <= rest.len());
                offset += consumed_bytes;
            }
            Err(error) => {
                // The termination request for it encodes.
                let mut out = Vec::new();
                pdu::encode_term_req_for(&mut out, framing.role, &error, rest);
                assert!(out.len() <= 152);
                return;
            }
        }
    }
});

/// Encodes what was decoded as its sender would, and decodes it again to the same PDU.
fn reencode(decoded: &Pdu<'_>, receiver: &Framing) {
    let sender = Framing {
        role: if receiver.role == Role::Host { Role::Controller } else { Role::Host },
        receive_pda: receiver.send_pda,
        send_pda: receiver.receive_pda,
        ..*receiver
    };
    let mut out = Vec::new();
    match decoded {
        Pdu::CapsuleCmd(capsule) => {
            pdu::encode_capsule_cmd(&mut out, &sender, &capsule.sqe, capsule.data)
        }
        Pdu::CapsuleResp(cqe) => pdu::encode_capsule_resp(&mut out, &sender, cqe),
        Pdu::R2T(r2t) => pdu::encode_r2t(&mut out, &sender, r2t),
        Pdu::H2CData(header, data) | Pdu::C2HData(header, data) => {
            pdu::encode_data_pdu(&mut out, &sender, header, data)
        }
        _ => return,
    }
    if out.len() > receiver.pdu_size_max as usize {
        return;
    }
    match pdu::decode(&out, receiver) {
        Ok(Decoded::Pdu { pdu, consumed_bytes }) => {
            assert_eq!(consumed_bytes, out.len());
            assert_eq!(&pdu, decoded);
        }
        other => panic!("a re-encoded PDU does not decode: {other:?}"),
    }
}
