//! Mounting for real and reading through the kernel: the mount guard, mount table and
//! process helpers, `pread`, `O_DIRECT` opens and a small seeded random generator.
