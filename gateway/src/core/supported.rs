//! What a controller of this target offers where the offer is conditional: the NVM command
//! set's I/O commands and the log pages. Identify Controller (ONCS, FUSES), the Commands
//! Supported and Effects log (05h), the Supported Log Pages log (00h) and the command
//! dispatchers all read these tables, so what one says the others do (a gateway with
//! `[gateway] reservations = false` offers none: its ONCS, its effects log and its I/O queues
//! must all say so; a gateway of a group offers the same set as a standalone one).

use super::target::Target;
use crate::spec::{ctrl as c, effects, io_opcode, log};

/// When a command or log page is offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Offered {
    Always,
    /// Only where the target offers reservations ([`Target::reservations_enabled`]).
    WithReservations,
}

impl Offered {
    fn by(self, target: &Target) -> bool {
        match self {
            Offered::Always => true,
            Offered::WithReservations => target.reservations_enabled(),
        }
    }
}

/// One I/O command of the NVM command set.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IoCommand {
    pub opcode: u8,
    /// Its entry in the Commands Supported and Effects log (CSUPP included).
    pub effects: u32,
    /// The ONCS bit that announces it; 0 for the mandatory commands.
    oncs: u16,
    offered: Offered,
}

const fn io_command(opcode: u8, effects: u32, oncs: u16, offered: Offered) -> IoCommand {
    IoCommand {
        opcode,
        effects,
        oncs,
        offered,
    }
}

/// Every I/O command the gateway implements.
const IO_COMMANDS: [IoCommand; 10] = [
    io_command(
        io_opcode::FLUSH,
        effects::CSUPP | effects::LBCC,
        0,
        Offered::Always,
    ),
    io_command(
        io_opcode::WRITE,
        effects::CSUPP | effects::LBCC,
        0,
        Offered::Always,
    ),
    io_command(io_opcode::READ, effects::CSUPP, 0, Offered::Always),
    io_command(
        io_opcode::COMPARE,
        effects::CSUPP,
        c::ONCS_COMPARE,
        Offered::Always,
    ),
    io_command(
        io_opcode::WRITE_ZEROES,
        effects::CSUPP | effects::LBCC,
        c::ONCS_WRITE_ZEROES,
        Offered::Always,
    ),
    io_command(
        io_opcode::DSM,
        effects::CSUPP | effects::LBCC,
        c::ONCS_DSM,
        Offered::Always,
    ),
    io_command(
        io_opcode::RESV_REGISTER,
        effects::CSUPP,
        c::ONCS_RESERVATIONS,
        Offered::WithReservations,
    ),
    io_command(
        io_opcode::RESV_REPORT,
        effects::CSUPP,
        c::ONCS_RESERVATIONS,
        Offered::WithReservations,
    ),
    io_command(
        io_opcode::RESV_ACQUIRE,
        effects::CSUPP,
        c::ONCS_RESERVATIONS,
        Offered::WithReservations,
    ),
    io_command(
        io_opcode::RESV_RELEASE,
        effects::CSUPP,
        c::ONCS_RESERVATIONS,
        Offered::WithReservations,
    ),
];

/// The I/O commands `target` offers.
pub(crate) fn io_commands(target: &Target) -> impl Iterator<Item = &'static IoCommand> + '_ {
    IO_COMMANDS.iter().filter(move |cmd| cmd.offered.by(target))
}

/// Whether `target` runs I/O command `opcode`.
pub(crate) fn io_command_offered(target: &Target, opcode: u8) -> bool {
    io_commands(target).any(|cmd| cmd.opcode == opcode)
}

/// Identify Controller ONCS: the bits of the optional commands offered.
pub(crate) fn oncs(target: &Target) -> u16 {
    io_commands(target).fold(0, |bits, cmd| bits | cmd.oncs)
}

/// Identify Controller FUSES: compare-and-write needs both of its halves.
pub(crate) fn fuses(target: &Target) -> u16 {
    if io_command_offered(target, io_opcode::COMPARE)
        && io_command_offered(target, io_opcode::WRITE)
    {
        c::FUSES_COMPARE_AND_WRITE
    } else {
        0
    }
}

/// Log pages of an I/O controller.
const IO_CONTROLLER_LOG_PAGES: [(u8, Offered); 8] = [
    (log::SUPPORTED, Offered::Always),
    (log::ERROR, Offered::Always),
    (log::SMART, Offered::Always),
    (log::FW_SLOT, Offered::Always),
    (log::CHANGED_NS, Offered::Always),
    (log::CMD_EFFECTS, Offered::Always),
    (log::ANA, Offered::Always),
    (log::RESERVATION, Offered::WithReservations),
];

/// Log page IDs a controller reports in the Supported Log Pages page and answers.
pub(crate) fn log_pages(target: &Target, discovery: bool) -> Vec<u8> {
    if discovery {
        return vec![log::SUPPORTED, log::DISC];
    }
    IO_CONTROLLER_LOG_PAGES
        .iter()
        .filter(|(_, offered)| offered.by(target))
        .map(|&(lid, _)| lid)
        .collect()
}
