// Address steering (BPF sk_lookup): a TCP connection to a VM's address on
// the VMs' port goes to the listening socket of the cell that holds the VM,
// so a VM needs no socket of its own. The parent loads and attaches this
// program and fills its maps (hypervisor/src/parent/steering.rs); an
// address it has not mapped is left to the kernel's own lookup.

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define AF_INET 2
#define IPPROTO_TCP 6

// The port every VM serves on (host byte order); set at load time.
const volatile __u32 vm_port = 0;

// VM address (network byte order) -> slot of its cell's socket.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 1); // sized at load time
} vm_cells SEC(".maps");

// Slot -> the cell's listening socket. A socket leaves the map when it is
// closed, so a dead cell's addresses find nothing and are refused.
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 1); // sized at load time
} cell_sockets SEC(".maps");

SEC("sk_lookup")
int steer(struct bpf_sk_lookup *ctx)
{
	if (ctx->family != AF_INET || ctx->protocol != IPPROTO_TCP || ctx->local_port != vm_port)
		return SK_PASS;
	__u32 addr = ctx->local_ip4;
	__u32 *slot = bpf_map_lookup_elem(&vm_cells, &addr);
	if (!slot)
		return SK_PASS;
	// No socket (its cell is gone): the kernel's own lookup finds none and
	// refuses. Passing, not dropping, also lets a later densevm on these
	// addresses be reached while an exited one's program is still detaching.
	struct bpf_sock *sk = bpf_map_lookup_elem(&cell_sockets, slot);
	if (!sk)
		return SK_PASS;
	bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	// An earlier program (another densevm on the same addresses) chose first.
	return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
