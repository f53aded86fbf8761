package zmqbridge

import (
	"reflect"
	"testing"
)

// inGroup is ev about KV cache group g, of kind ("" = not said).
func inGroup(ev Event, g int64, kind string) Event {
	ev.HasGroupIdx, ev.GroupIdx = true, g
	if ev.Kind == KindBlockStored {
		ev.SpecKind = kind
	}
	return ev
}

// TestBridgeConverterGroups: which KV cache group reaches the index, for
// each way an engine describes its groups. Every hybrid group caches the
// same engine hashes; only the followed group's stores and removals count.
func TestBridgeConverterGroups(t *testing.T) {
	a, b := tokens(0, 2), tokens(500, 1) // a: two blocks (hashes 1, 2), b: one (hash 3)
	full := func(toks ...[]uint32) map[uint64]bool {
		out := map[uint64]bool{}
		for _, tk := range toks {
			for _, h := range seqHashes(tk, "") {
				out[h] = true
			}
		}
		return out
	}
	storeA := stored([]uint64{1, 2}, nil, a)
	storeB := stored([]uint64{3}, nil, b)
	cases := []struct {
		name   string
		follow *int64 // configured kv_cache_group
		evs    []Event
		want   map[uint64]bool
		skip   map[SkipReason]uint64
		rule   GroupState
		group  int64
	}{
		{name: "no group_idx (SGLang, old vLLM): group 0",
			evs: []Event{storeA}, want: full(a), rule: GroupSingle},
		{name: "group_idx 0 only, no kinds: a single-group model",
			evs: []Event{inGroup(storeA, 0, ""), inGroup(removed(2), 0, "")}, want: full(a[:16]), rule: GroupSingle},
		{name: "Gemma-like: group 0 sliding window, group 1 full attention",
			evs: []Event{
				inGroup(storeA, 0, "sliding_window"), inGroup(storeA, 1, "full_attention"),
				inGroup(removed(1, 2), 0, ""), // the window moved on: group 1 still holds the prefix
				inGroup(storeB, 2, "sliding_window"),
			},
			want: full(a), skip: map[SkipReason]uint64{SkipOtherGroup: 3}, rule: GroupFullAttention, group: 1},
		{name: "full attention first: group 0, sliding group 1 ignored",
			evs: []Event{
				inGroup(storeA, 0, "full_attention"), inGroup(storeA, 1, "sliding_window"), inGroup(storeB, 1, "sliding_window"),
				inGroup(removed(2), 0, ""), inGroup(removed(1), 1, ""),
			},
			want: full(a[:16]), skip: map[SkipReason]uint64{SkipOtherGroup: 3}, rule: GroupFullAttention, group: 0},
		{name: "two full-attention groups: the first stands for both",
			evs:  []Event{inGroup(storeA, 0, "mla_attention"), inGroup(storeA, 3, "full_attention"), inGroup(removed(1, 2), 3, "")},
			want: full(a), skip: map[SkipReason]uint64{SkipOtherGroup: 2}, rule: GroupFullAttention, group: 0},
		{name: "hybrid without kinds: refused, group 0's blocks cleared",
			evs:  []Event{inGroup(storeA, 0, ""), inGroup(storeB, 1, ""), inGroup(storeB, 0, ""), inGroup(removed(3), 0, "")},
			want: map[uint64]bool{}, skip: map[SkipReason]uint64{SkipUnknownGroup: 3}, rule: GroupRefused, group: -1},
		{name: "refused, then the engine says kinds",
			evs:  []Event{inGroup(storeA, 0, ""), inGroup(storeA, 1, ""), inGroup(storeB, 1, "full_attention")},
			want: full(b), skip: map[SkipReason]uint64{SkipUnknownGroup: 1}, rule: GroupFullAttention, group: 1},
		{name: "kinds arrive after group 0 was followed: switch and clear",
			evs:  []Event{inGroup(storeA, 0, ""), inGroup(storeB, 2, "full_attention")},
			want: full(b), rule: GroupFullAttention, group: 2},
		{name: "only non-full kinds: nothing indexed",
			evs:  []Event{inGroup(storeA, 0, "mamba"), inGroup(storeB, 0, "sliding_window")},
			want: map[uint64]bool{}, skip: map[SkipReason]uint64{SkipOtherGroup: 2}, rule: GroupNone, group: -1},
		{name: "configured group, whatever the kinds say",
			follow: new(int64(2)),
			evs:    []Event{inGroup(storeA, 0, "full_attention"), inGroup(storeB, 2, "sliding_window"), inGroup(storeA, 1, "")},
			want:   full(b), skip: map[SkipReason]uint64{SkipOtherGroup: 2}, rule: GroupConfigured, group: 2},
		{name: "configured group 0 and events without group_idx",
			follow: new(int64(0)),
			evs:    []Event{storeA, inGroup(storeB, 1, "")},
			want:   full(a), skip: map[SkipReason]uint64{SkipOtherGroup: 1}, rule: GroupConfigured, group: 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			conv, sink := NewConverter(16, 0), newRecordSink(16)
			if c.follow != nil {
				conv.FollowGroup(*c.follow)
			}
			convertAll(t, conv, sink, c.evs...)
			st := conv.Stats()
			if got := sink.contents(); !reflect.DeepEqual(got, c.want) && (len(got) != 0 || len(c.want) != 0) {
				t.Errorf("index %v, want %v (events %s)", got, c.want, sink.kinds())
			}
			skips := map[SkipReason]uint64{}
			for r, n := range st.Skipped {
				if n > 0 {
					skips[r] = n
				}
			}
			if len(skips) != len(c.skip) || (len(c.skip) > 0 && !reflect.DeepEqual(skips, c.skip)) {
				t.Errorf("skipped %v, want %v", skips, c.skip)
			}
			if st.GroupRule != c.rule || st.Group != c.group {
				t.Errorf("rule %s group %d, want %s %d", st.GroupRule, st.Group, c.rule, c.group)
			}
		})
	}
}

// TestBridgeConverterNamespaced: SGLang blocks in a cache namespace never
// reach the index, and neither do their children (their parent is unknown).
func TestBridgeConverterNamespaced(t *testing.T) {
	conv, sink := NewConverter(16, 0), newRecordSink(16)
	salted := stored([]uint64{1}, nil, tokens(0, 1))
	salted.CacheSalt, salted.Namespaced = "tenant-a", true
	child := stored([]uint64{2}, ptr(1), tokens(16, 1))
	plain := stored([]uint64{3}, nil, tokens(0, 1))
	errs := convertAll(t, conv, sink, salted, child, plain)
	st := conv.Stats()
	if len(errs) != 2 || st.Skipped[SkipNamespaced] != 1 || st.Skipped[SkipUnknownParent] != 1 {
		t.Fatalf("errs %v stats %+v", errs, st)
	}
	if got := sink.contents(); len(got) != 1 || !got[seqHashes(tokens(0, 1), "")[0]] {
		t.Fatalf("index %v", got)
	}
}
