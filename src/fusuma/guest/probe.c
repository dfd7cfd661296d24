/*
 * fusuma probe: the evaluation program of the Mint + KVM paper (papers/README.md §1),
 * timed with the TSC. Built static (gcc -O2 -static) so the same binary runs on the
 * host and in the busybox guest.
 *
 *   probe --test register|copy|io|all [--reps 10] [--m N] [--n N] [--l N]
 *         [--disk PATH] [--sizes 256,512,1024] [--seed S] [--verify]
 *
 *   register  increment a register M times (inline asm: the compiler cannot fold it)
 *   copy      memcpy of each size (KiB), N times
 *   io        lseek to a random aligned offset, then read each size, L times, from
 *             PATH opened with O_DIRECT (no page cache between the probe and the device)
 *
 * Output: one JSON line per (test, size), holding every repetition:
 *   {"probe": 1, "test": "copy", "size_kib": 256, "count": N, "tsc_hz": 2994000000,
 *    "cycles": [...], "ns": [...], "wall_ns": [...]}
 * cycles is the TSC difference of a repetition, ns the same converted with tsc_hz (the
 * TSC frequency, calibrated against CLOCK_MONOTONIC at start), wall_ns CLOCK_MONOTONIC
 * read around the same repetition as a cross-check. io lines add "disk_bytes" and
 * "fresh" (true when no block was read twice in this run: with a large enough disk
 * the io offsets are a random permutation of distinct slots, so no cache anywhere can
 * serve a repeated read). Errors go to stderr; exit 2 on bad arguments, 1 on failure.
 *
 * --verify (io): the disk was written so that every 4 KiB block starts with its own
 * byte offset (little-endian u64); after each repetition the last buffer read is
 * checked against that, so a sparse file or a wrong device cannot pass as a fast one.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

#define MAX_SIZES 8
#define MAX_REPS 1000
#define BLOCK 4096

struct opts {
	int reg, copy, io, verify;
	int reps;
	uint64_t m, n, l, seed;
	const char *disk;
	int nsizes;
	uint64_t sizes_kib[MAX_SIZES];
};

static double tsc_hz;

/* Print "probe: <fmt with arg>[: <errno text>]" and exit 1. */
static void die(const char *fmt, const char *arg)
{
	int err = errno;
	fprintf(stderr, "probe: ");
	fprintf(stderr, fmt, arg);
	if (err)
		fprintf(stderr, ": %s", strerror(err));
	fprintf(stderr, "\n");
	exit(1);
}

static void usage(const char *msg)
{
	fprintf(stderr, "probe: %s\nusage: probe --test register|copy|io|all [--reps R] "
		"[--m M] [--n N] [--l L] [--disk PATH] [--sizes KIB,...] [--seed S] "
		"[--verify]\n", msg);
	exit(2);
}

/* Serialised TSC read: lfence keeps earlier instructions from drifting past it. */
static inline uint64_t tsc(void)
{
	_mm_lfence();
	uint64_t t = __rdtsc();
	_mm_lfence();
	return t;
}

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One bracketed (tsc, monotonic) sample: the monotonic read whose surrounding TSC
 * reads are closest together, out of a few tries. */
static void sample(uint64_t *t, uint64_t *ns)
{
	uint64_t best = UINT64_MAX;
	for (int i = 0; i < 16; i++) {
		uint64_t a = tsc(), m = mono_ns(), b = tsc();
		if (b - a < best) {
			best = b - a;
			*t = a + (b - a) / 2;
			*ns = m;
		}
	}
}

static void calibrate(void)
{
	uint64_t t0, n0, t1, n1;
	struct timespec nap = {0, 200 * 1000 * 1000};
	sample(&t0, &n0);
	nanosleep(&nap, NULL);
	sample(&t1, &n1);
	if (n1 <= n0 || t1 <= t0)
		errno = 0, die("%s", "the TSC or CLOCK_MONOTONIC did not advance during calibration");
	tsc_hz = (double)(t1 - t0) * 1e9 / (double)(n1 - n0);
}

static uint64_t to_ns(uint64_t cycles)
{
	return (uint64_t)((double)cycles * 1e9 / tsc_hz + 0.5);
}

static void emit(const char *test, uint64_t size_kib, uint64_t count, int reps,
		 const uint64_t *cycles, const uint64_t *wall, const char *extra)
{
	printf("{\"probe\": 1, \"test\": \"%s\", \"size_kib\": ", test);
	if (size_kib)
		printf("%" PRIu64, size_kib);
	else
		printf("null");
	printf(", \"count\": %" PRIu64 ", \"reps\": %d, \"tsc_hz\": %.0f%s", count, reps,
	       tsc_hz, extra);
	const char *keys[] = {"cycles", "ns", "wall_ns"};
	for (int k = 0; k < 3; k++) {
		printf(", \"%s\": [", keys[k]);
		for (int r = 0; r < reps; r++) {
			uint64_t v = k == 0 ? cycles[r] : k == 1 ? to_ns(cycles[r]) : wall[r];
			printf("%s%" PRIu64, r ? ", " : "", v);
		}
		printf("]");
	}
	printf("}\n");
	fflush(stdout);
}

/* -- register ------------------------------------------------------------------- */

static void test_register(const struct opts *o)
{
	uint64_t cycles[MAX_REPS], wall[MAX_REPS];
	for (int r = 0; r < o->reps; r++) {
		uint64_t reg = 0, left = o->m;
		uint64_t w0 = mono_ns(), t0 = tsc();
		if (left)
			__asm__ volatile("1:\n\tinc %0\n\tdec %1\n\tjnz 1b"
					 : "+r"(reg), "+r"(left) : : "cc");
		uint64_t t1 = tsc(), w1 = mono_ns();
		if (reg != o->m)
			errno = 0, die("%s", "register test: the register does not hold M at the end");
		cycles[r] = t1 - t0;
		wall[r] = w1 - w0;
	}
	emit("register", 0, o->m, o->reps, cycles, wall, "");
}

/* -- copy ----------------------------------------------------------------------- */

static void *alloc(size_t bytes)
{
	void *p = NULL;
	if (posix_memalign(&p, BLOCK, bytes) != 0)
		die("%s", "out of memory");
	return p;
}

static void test_copy(const struct opts *o)
{
	uint64_t cycles[MAX_REPS], wall[MAX_REPS];
	for (int s = 0; s < o->nsizes; s++) {
		size_t bytes = o->sizes_kib[s] * 1024;
		unsigned char *src = alloc(bytes), *dst = alloc(bytes);
		for (size_t i = 0; i < bytes; i++)   /* touch every page before timing */
			src[i] = (unsigned char)(i * 131 + s);
		memset(dst, 0, bytes);
		for (int r = 0; r < o->reps; r++) {
			uint64_t w0 = mono_ns(), t0 = tsc();
			for (uint64_t i = 0; i < o->n; i++) {
				memcpy(dst, src, bytes);
				/* dst is "used": the copies cannot be elided or merged */
				__asm__ volatile("" : : "r"(dst) : "memory");
			}
			uint64_t t1 = tsc(), w1 = mono_ns();
			if (o->n && memcmp(dst, src, bytes) != 0)
				errno = 0, die("%s", "copy test: the destination differs from the source");
			cycles[r] = t1 - t0;
			wall[r] = w1 - w0;
			src[r % bytes] ^= 1;   /* the next repetition copies new data */
		}
		emit("copy", o->sizes_kib[s], o->n, o->reps, cycles, wall, "");
		free(src);
		free(dst);
	}
}

/* -- io ------------------------------------------------------------------------- */

static uint64_t rng_state;

static uint64_t rnd(void)   /* xorshift64* */
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 2685821657736338717ull;
}

static void test_io(const struct opts *o)
{
	uint64_t cycles[MAX_REPS], wall[MAX_REPS];
	uint64_t slot = 0;
	for (int s = 0; s < o->nsizes; s++)
		if (o->sizes_kib[s] * 1024 > slot)
			slot = o->sizes_kib[s] * 1024;
	int fd = open(o->disk, O_RDONLY | O_DIRECT | O_CLOEXEC);
	if (fd < 0)
		die("cannot open %s with O_DIRECT", o->disk);
	off_t end = lseek(fd, 0, SEEK_END);
	if (end >= 0 && (uint64_t)end < slot)
		errno = 0;
	if (end < 0 || (uint64_t)end < slot)
		die("%s is smaller than the largest read size", o->disk);
	uint64_t nslots = (uint64_t)end / slot;
	uint64_t need = (uint64_t)o->reps * o->l * (uint64_t)o->nsizes;
	/* A random permutation of the slots; reads take slots in this order, so no
	 * block is read twice while there are slots left. */
	uint64_t *perm = malloc(nslots * sizeof(*perm));
	if (!perm)
		die("%s", "out of memory");
	for (uint64_t i = 0; i < nslots; i++)
		perm[i] = i;
	for (uint64_t i = nslots - 1; i > 0; i--) {
		uint64_t j = rnd() % (i + 1), t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	uint64_t next = 0;
	unsigned char *buf = alloc(slot);
	char extra[96];
	snprintf(extra, sizeof(extra), ", \"disk_bytes\": %" PRIu64 ", \"fresh\": %s",
		 (uint64_t)end, need <= nslots ? "true" : "false");
	for (int s = 0; s < o->nsizes; s++) {
		size_t bytes = o->sizes_kib[s] * 1024;
		for (int r = 0; r < o->reps; r++) {
			uint64_t off = 0;
			uint64_t w0 = mono_ns(), t0 = tsc();
			for (uint64_t i = 0; i < o->l; i++) {
				/* a random position inside the slot, aligned to the read size's
				 * block, so reads smaller than a slot do not all start at its
				 * beginning */
				uint64_t within = (slot - bytes) / BLOCK;
				off = perm[next++ % nslots] * slot +
				      (within ? rnd() % (within + 1) : 0) * BLOCK;
				if (lseek(fd, (off_t)off, SEEK_SET) != (off_t)off)
					die("lseek on %s failed", o->disk);
				ssize_t got = read(fd, buf, bytes);
				if (got != (ssize_t)bytes) {
					if (got >= 0)
						errno = 0;
					die("short or failed read from %s", o->disk);
				}
			}
			uint64_t t1 = tsc(), w1 = mono_ns();
			if (o->verify && o->l) {
				for (size_t b = 0; b < bytes; b += BLOCK) {
					uint64_t want = off + b, have;
					memcpy(&have, buf + b, sizeof(have));
					if (have != want)
						errno = 0, die("io test: %s does not hold the expected data "
						    "(was it written by fusuma?)", o->disk);
				}
			}
			cycles[r] = t1 - t0;
			wall[r] = w1 - w0;
		}
		emit("io", o->sizes_kib[s], o->l, o->reps, cycles, wall, extra);
	}
	free(buf);
	free(perm);
	close(fd);
}

/* -- arguments ------------------------------------------------------------------ */

static uint64_t number(const char *name, const char *v)
{
	char *end;
	errno = 0;
	unsigned long long x = strtoull(v, &end, 10);
	if (errno || *v == '\0' || *end != '\0' || *v == '-') {
		fprintf(stderr, "probe: %s wants a non-negative integer, not '%s'\n", name, v);
		exit(2);
	}
	return x;
}

static void parse_sizes(struct opts *o, const char *v)
{
	char copy[256];
	snprintf(copy, sizeof(copy), "%s", v);
	o->nsizes = 0;
	for (char *tok = strtok(copy, ","); tok; tok = strtok(NULL, ",")) {
		if (o->nsizes == MAX_SIZES)
			usage("too many --sizes");
		uint64_t kib = number("--sizes", tok);
		if (kib == 0 || kib % 4)
			usage("every size must be a positive multiple of 4 KiB");
		o->sizes_kib[o->nsizes++] = kib;
	}
	if (!o->nsizes)
		usage("--sizes is empty");
}

int main(int argc, char **argv)
{
	struct opts o = {.reps = 10, .m = 100000000, .n = 1000, .l = 100};
	const char *test = NULL;
	o.seed = (uint64_t)mono_ns() ^ ((uint64_t)getpid() << 32);
	parse_sizes(&o, "256,512,1024");
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--verify")) {
			o.verify = 1;
			continue;
		}
		if (i + 1 >= argc)
			usage("an option is missing its value");
		const char *v = argv[++i];
		if (!strcmp(a, "--test"))
			test = v;
		else if (!strcmp(a, "--reps"))
			o.reps = (int)number(a, v);
		else if (!strcmp(a, "--m"))
			o.m = number(a, v);
		else if (!strcmp(a, "--n"))
			o.n = number(a, v);
		else if (!strcmp(a, "--l"))
			o.l = number(a, v);
		else if (!strcmp(a, "--seed"))
			o.seed = number(a, v);
		else if (!strcmp(a, "--disk"))
			o.disk = v;
		else if (!strcmp(a, "--sizes"))
			parse_sizes(&o, v);
		else
			usage("unknown option");
	}
	if (!test)
		usage("--test is required");
	o.reg = !strcmp(test, "register") || !strcmp(test, "all");
	o.copy = !strcmp(test, "copy") || !strcmp(test, "all");
	o.io = !strcmp(test, "io") || !strcmp(test, "all");
	if (!o.reg && !o.copy && !o.io)
		usage("--test must be register, copy, io or all");
	if (o.reps < 1 || o.reps > MAX_REPS)
		usage("--reps must be 1..1000");
	if (o.io && !o.disk)
		usage("the io test needs --disk PATH");
	rng_state = o.seed ? o.seed : 1;
	calibrate();
	if (o.reg)
		test_register(&o);
	if (o.copy)
		test_copy(&o);
	if (o.io)
		test_io(&o);
	return 0;
}
