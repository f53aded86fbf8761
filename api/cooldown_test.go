package api

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

func TestCooldown(t *testing.T) {
	t0 := time.Unix(1000, 0)
	rw := func(id string, r router.Role) router.RoleWorker {
		return router.RoleWorker{WorkerInfo: router.WorkerInfo{ID: router.WorkerID(id)}, Role: r}
	}
	cases := []struct {
		name   string
		failed []router.WorkerID
		at     time.Duration // after the failures
		cands  []router.WorkerID
		want   []router.WorkerID
		// two-stage exclusion over these workers
		roles      []router.RoleWorker
		wantDisagg []router.WorkerID
	}{
		{name: "nothing failed", cands: []router.WorkerID{"a", "b"}},
		{name: "one cooling", failed: []router.WorkerID{"a"}, cands: []router.WorkerID{"a", "b"}, want: []router.WorkerID{"a"}},
		{name: "expired", failed: []router.WorkerID{"a"}, at: 6 * time.Second, cands: []router.WorkerID{"a", "b"}},
		{name: "all cooling: none excluded", failed: []router.WorkerID{"a", "b"}, cands: []router.WorkerID{"a", "b"}},
		{name: "prefill workers excluded even when all cool", failed: []router.WorkerID{"p1", "p2"},
			roles:      []router.RoleWorker{rw("p1", router.RolePrefill), rw("p2", router.RolePrefill), rw("d", router.RoleDecode)},
			wantDisagg: []router.WorkerID{"p1", "p2"}},
		{name: "the last decoder is kept", failed: []router.WorkerID{"d", "p1"},
			roles:      []router.RoleWorker{rw("p1", router.RolePrefill), rw("d", router.RoleDecode)},
			wantDisagg: []router.WorkerID{"p1"}},
		{name: "a cooling both-worker is a decoder", failed: []router.WorkerID{"b"},
			roles:      []router.RoleWorker{rw("b", router.RoleBoth), rw("d", router.RoleDecode)},
			wantDisagg: []router.WorkerID{"b"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newCooldown(5 * time.Second)
			for _, w := range tc.failed {
				c.fail(w, t0)
			}
			now := t0.Add(tc.at + time.Second)
			if got := c.exclude(tc.cands, now); !slices.Equal(got, tc.want) {
				t.Errorf("exclude %v, want %v", got, tc.want)
			}
			if got := c.excludeDisagg(tc.roles, now); !slices.Equal(got, tc.wantDisagg) {
				t.Errorf("excludeDisagg %v, want %v", got, tc.wantDisagg)
			}
		})
	}
	off := newCooldown(-1)
	off.fail("a", t0)
	if got := off.exclude([]router.WorkerID{"a", "b"}, t0); got != nil {
		t.Errorf("disabled cooldown excluded %v", got)
	}
}
