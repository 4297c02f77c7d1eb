// Helpers shared by every kernel that reads weights. Weight bytes are read through 32-bit words so
// that kernels need no 8- or 16-bit storage features; blocks of 18, 34 or 210 bytes are not
// word-aligned, but every block starts on an even byte, so 16-bit reads never straddle a word.

uint load_u8(uint byte_offset) {
    return (weights[byte_offset >> 2] >> ((byte_offset & 3u) * 8u)) & 0xFFu;
}

int load_i8(uint byte_offset) {
    return int(load_u8(byte_offset) << 24) >> 24;
}

// `byte_offset` must be even.
uint load_u16(uint byte_offset) {
    return (weights[byte_offset >> 2] >> ((byte_offset & 2u) * 8u)) & 0xFFFFu;
}

float load_f16(uint byte_offset) {
    return unpackHalf2x16(load_u16(byte_offset)).x;
}
