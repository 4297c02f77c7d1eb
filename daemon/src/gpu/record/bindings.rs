//! What a dispatch binds, and the hazards between dispatches that decide the barriers.

use ash::vk;

use crate::gpu::buffer::Buffer;

/// How a dispatch uses a binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    /// Written, and perhaps read too.
    Write,
}

/// A range of a buffer bound to one binding.
#[derive(Clone, Copy)]
pub struct Binding<'b> {
    pub buffer: &'b Buffer,
    pub offset: u64,
    pub range: u64,
    pub access: Access,
}

impl<'b> Binding<'b> {
    pub fn read(buffer: &'b Buffer) -> Binding<'b> {
        Binding {
            buffer,
            offset: 0,
            range: buffer.size(),
            access: Access::Read,
        }
    }

    pub fn write(buffer: &'b Buffer) -> Binding<'b> {
        Binding {
            access: Access::Write,
            ..Binding::read(buffer)
        }
    }
}

/// Buffers touched since the last barrier.
#[derive(Default)]
pub(super) struct Hazards {
    read: Vec<vk::Buffer>,
    written: Vec<vk::Buffer>,
}

impl Hazards {
    pub(super) fn conflicts(&self, b: &Binding<'_>) -> bool {
        let raw = b.buffer.raw;
        self.written.contains(&raw) || (b.access == Access::Write && self.read.contains(&raw))
    }

    pub(super) fn note(&mut self, b: &Binding<'_>) {
        let list = match b.access {
            Access::Read => &mut self.read,
            Access::Write => &mut self.written,
        };
        if !list.contains(&b.buffer.raw) {
            list.push(b.buffer.raw);
        }
    }
}
