// Helpers shared by every kernel. Weight bytes are read through 32-bit words so that kernels need
// no 8- or 16-bit storage features; blocks of 18 or 34 bytes are not word-aligned.

uint load_u8(uint byte_offset) {
    return (weights[byte_offset >> 2] >> ((byte_offset & 3u) * 8u)) & 0xFFu;
}

int load_i8(uint byte_offset) {
    return int(load_u8(byte_offset) << 24) >> 24;
}

uint load_u16(uint byte_offset) {
    return load_u8(byte_offset) | (load_u8(byte_offset + 1u) << 8);
}

float load_f16(uint byte_offset) {
    return unpackHalf2x16(load_u16(byte_offset)).x;
}
