package zmqbridge

// KV cache groups. vLLM's hybrid allocator keeps one KV cache group per
// attention type (and splits a type into several groups of equal layer
// count): Gemma 3 and gpt-oss have sliding-window and full-attention
// groups, Llama 4 chunked-local and full. Every group caches the same
// block hashes, and events say which group they are about (group_idx, and
// since vllm#40984 kv_cache_spec_kind on stores).
//
// A request reuses a prefix only as far as every group can serve it
// (HybridKVCacheCoordinator.find_longest_cache_hit): the full-attention
// group gives the longest cached prefix, the others can only shorten it (a
// sliding-window group needs just the window's blocks before the hit
// point and frees the rest). So the prefix index follows exactly one
// full-attention group: its chain is what a request can reuse, at most.
// The other groups are skipped and counted (other_group); merging them
// would keep a block indexed while any group held it, or drop it when a
// sliding window moved on.
//
// Group 0 is not that group in general: vLLM orders groups by the first
// layer of each attention type, and Gemma 3, gpt-oss and Llama 4 start
// with a sliding-window or chunked layer. Hence:
//
//   - configured (WorkerSpec.KVCacheGroup): that group, whatever else;
//   - events that name kinds: the first group named full attention; the
//     others are other_group (vLLM's full-attention groups of one spec
//     hold the same blocks, any one of them stands for all);
//   - events that name no kind and no group but 0 (every engine before
//     group_idx, SGLang, single-group models): group 0, the only one;
//   - a group besides 0 without kinds: a hybrid model whose full-attention
//     group is unknown. Nothing is indexed (unknown_group, logged) until
//     kv_cache_group is configured or the engine sends kinds.
//
// Whenever the indexed group changes, the rank's blocks are cleared: they
// came from another group.

// GroupState says how the converter chose the KV cache group it indexes.
type GroupState string

// Group states.
const (
	GroupSingle        GroupState = "single"         // no kinds, no group besides 0: group 0
	GroupFullAttention GroupState = "full_attention" // the first group the events call full attention
	GroupConfigured    GroupState = "configured"     // WorkerSpec.KVCacheGroup
	GroupNone          GroupState = "none"           // kinds known, no full-attention group seen yet
	GroupRefused       GroupState = "refused"        // hybrid without kinds: nothing indexed
)

// maxKnownGroups bounds the group kinds a converter remembers (group_idx is
// the engine's to choose; real models have a handful).
const maxKnownGroups = 256

// fullAttentionKinds are vLLM's kv_cache_spec_kind values of
// FullAttentionSpec and its subclasses: groups whose cached blocks form a
// prefix (downward closed).
var fullAttentionKinds = map[string]bool{"full_attention": true, "mla_attention": true, "sink_full_attention": true}

type groupPolicy struct {
	state    GroupState
	followed int64 // -1: none
	kinds    map[int64]string
}

func newGroupPolicy() groupPolicy {
	return groupPolicy{state: GroupSingle, followed: 0, kinds: map[int64]string{}}
}

// decide says whether a stored or removed event's group is indexed (err
// nil) and whether the blocks indexed so far must be cleared first.
func (p *groupPolicy) decide(ev *Event) (reset bool, err *SkipError) {
	g := int64(0)
	if ev.HasGroupIdx {
		g = ev.GroupIdx
	}
	kind := ev.SpecKind
	if ev.Kind == KindBlockStored && kind != "" {
		if _, ok := p.kinds[g]; ok || len(p.kinds) < maxKnownGroups {
			p.kinds[g] = kind
		}
	}
	if kind == "" {
		kind = p.kinds[g] // removals name no kind: the group's stores did
	}
	if p.state == GroupConfigured {
		if g == p.followed {
			return false, nil
		}
		return false, skip(SkipOtherGroup, "%s of KV cache group %d; kv_cache_group %d is configured", ev.Kind, g, p.followed)
	}
	if kind != "" {
		if p.state == GroupFullAttention {
			if g == p.followed {
				return false, nil
			}
			return false, skip(SkipOtherGroup, "%s of KV cache group %d (%s); indexing full-attention group %d", ev.Kind, g, kind, p.followed)
		}
		if fullAttentionKinds[kind] {
			reset = p.followed >= 0 && p.followed != g
			p.state, p.followed = GroupFullAttention, g
			return reset, nil
		}
		reset = p.state == GroupSingle && p.followed >= 0
		p.state, p.followed = GroupNone, -1
		return reset, skip(SkipOtherGroup, "%s of KV cache group %d (%s): not full attention", ev.Kind, g, kind)
	}
	switch p.state {
	case GroupFullAttention:
		if g == p.followed {
			return false, nil
		}
		return false, skip(SkipOtherGroup, "%s of KV cache group %d; indexing full-attention group %d", ev.Kind, g, p.followed)
	case GroupNone:
		return false, skip(SkipOtherGroup, "%s of KV cache group %d of unknown kind; no full-attention group seen yet", ev.Kind, g)
	case GroupRefused:
		return false, skip(SkipUnknownGroup, "%s of KV cache group %d: hybrid model without kv_cache_spec_kind; set kv_cache_group", ev.Kind, g)
	}
	if g == 0 {
		return false, nil
	}
	// A second group, and nothing says which one is full attention: what
	// group 0 gave the index may be a sliding window's.
	p.state, p.followed = GroupRefused, -1
	return true, skip(SkipUnknownGroup, "%s of KV cache group %d: a hybrid model whose events do not say which group is full attention "+
		"(vLLM before kv_cache_spec_kind); nothing is indexed until the worker's kv_cache_group names the full-attention group", ev.Kind, g)
}
