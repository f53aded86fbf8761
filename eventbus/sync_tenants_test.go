package eventbus

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// tenantSink is a recSink that also takes tenant usage.
type tenantSink struct {
	*recSink
	tmu     sync.Mutex
	tenants map[string][]TenantUsage
}

func newTenantSink() *tenantSink {
	return &tenantSink{recSink: newRecSink(), tenants: map[string][]TenantUsage{}}
}

func (s *tenantSink) TenantsRemote(replica string, u []TenantUsage) {
	s.tmu.Lock()
	defer s.tmu.Unlock()
	s.tenants[replica] = u
}

func (s *tenantSink) usage(replica string) []TenantUsage {
	s.tmu.Lock()
	defer s.tmu.Unlock()
	return s.tenants[replica]
}

// TestSyncTenants: a tenant-usage message reaches a sink that takes it,
// clamped; a sink without TenantSink, or a format version this build does
// not know, applies nothing; an older peer decodes the message without
// error (its op is unknown to it: ignored) and its sequence stays whole.
func TestSyncTenants(t *testing.T) {
	long := strings.Repeat("x", MaxSyncTenantID+1)
	tests := []struct {
		name string
		msg  SyncMsg
		want []TenantUsage
	}{
		{"usage", SyncMsg{Tenants: []TenantUsage{{Model: "m", Tenant: "a", Tokens: 10, Lift: 4, Waiting: 2, Class: 1, Inflight: 3}}, TenantsVersion: 1},
			[]TenantUsage{{Model: "m", Tenant: "a", Tokens: 10, Lift: 4, Waiting: 2, Class: 1, Inflight: 3}}},
		{"clamped", SyncMsg{Tenants: []TenantUsage{{Model: "m", Tenant: "a", Tokens: 1 << 63, Lift: 1 << 62, Waiting: -5, Inflight: 1 << 40}}, TenantsVersion: 1},
			[]TenantUsage{{Model: "m", Tenant: "a", Tokens: MaxSyncTenantTokens, Lift: MaxSyncTenantTokens, Inflight: MaxSyncTenantCount}}},
		{"malformed entries dropped", SyncMsg{Tenants: []TenantUsage{{Model: "", Tenant: "a"}, {Model: "m", Tenant: ""}, {Model: "m", Tenant: long}, {Model: "m", Tenant: "b"}}, TenantsVersion: 1},
			[]TenantUsage{{Model: "m", Tenant: "b"}}},
		{"unknown version ignored", SyncMsg{Tenants: []TenantUsage{{Model: "m", Tenant: "a", Tokens: 1}}, TenantsVersion: 2}, nil},
		{"no version ignored", SyncMsg{Tenants: []TenantUsage{{Model: "m", Tenant: "a", Tokens: 1}}}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sink := newTenantSink()
			s, err := NewSyncer(nil, SyncConfig{Replica: "me", Clock: newFakeClock(), Logger: testLogger(t)}, sink)
			if err != nil {
				t.Fatal(err)
			}
			m := tc.msg
			m.Replica, m.Epoch, m.Seq, m.Op = "r1", 1, 1, SyncTenants
			data, err := msgpack.Marshal(&m)
			if err != nil {
				t.Fatal(err)
			}
			s.handle(&nats.Msg{Data: data})
			if got := sink.usage("r1"); fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("sink holds %+v, want %+v", got, tc.want)
			}
			if st := s.Stats(); st.Undecodable != 0 || st.Gaps != 0 {
				t.Fatalf("stats %+v", st)
			}
		})
	}

	// A sink without TenantSink (fairness off) applies nothing, quietly.
	plain := newRecSink()
	s, _ := NewSyncer(nil, SyncConfig{Replica: "me", Clock: newFakeClock(), Logger: testLogger(t)}, plain)
	s.deliver(SyncMsg{Replica: "r1", Epoch: 1, Seq: 1, Op: SyncTenants, TenantsVersion: 1, Tenants: []TenantUsage{{Model: "m", Tenant: "a"}}}, time.Unix(0, 0))
	if st := s.Stats(); st.Undecodable != 0 || st.Received != 1 {
		t.Fatalf("stats %+v", st)
	}

	// An older peer: the keys are unknown to its decoder, the op too.
	data, _ := msgpack.Marshal(&SyncMsg{Replica: "r1", Epoch: 1, Seq: 7, Op: SyncTenants, TenantsVersion: 1, Tenants: []TenantUsage{{Model: "m", Tenant: "a", Tokens: 9}}})
	var old syncMsgV1
	if err := msgpack.Unmarshal(data, &old); err != nil || old.Op != SyncTenants || old.Seq != 7 {
		t.Fatalf("an older peer read %+v (%v)", old, err)
	}
}

// TestBusReplicaSyncTenants: over a real NATS server, a replica's tenant
// usage reaches the other on a nudge (TenantsChanged) without waiting for
// the interval (an hour here), and a change follows the next nudge.
func TestBusReplicaSyncTenants(t *testing.T) {
	log := testLogger(t)
	srv := startSingleMode(t, log, insecureMode)
	ncA, _ := insecureMode.replica(t, srv.ClientURL(), "A", log)
	ncB, _ := insecureMode.replica(t, srv.ClientURL(), "B", log)
	var mu sync.Mutex
	tokens := uint64(1)
	source := func() []TenantUsage {
		mu.Lock()
		defer mu.Unlock()
		return []TenantUsage{{Model: "m", Tenant: "a", Tokens: tokens}}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sinkB := newTenantSink()
	nudge := make(chan struct{}, 1)
	a, err := NewSyncer(ncA, SyncConfig{Replica: "A", Tenants: source, TenantInterval: time.Hour, TenantsChanged: nudge,
		Logger: log}, newTenantSink())
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewSyncer(ncB, SyncConfig{Replica: "B", Logger: log}, sinkB)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Add(2)
	go func() { defer wg.Done(); _ = a.Run(ctx) }()
	go func() { defer wg.Done(); _ = b.Run(ctx) }()
	want := func(n uint64) {
		poll.Until(t, 5*time.Second, 10*time.Millisecond, func() error {
			select { // until B has subscribed, a publication is lost
			case nudge <- struct{}{}:
			default:
			}
			if u := sinkB.usage("A"); len(u) != 1 || u[0].Tokens != n {
				return fmt.Errorf("B holds %+v, want %d tokens", u, n)
			}
			return nil
		})
	}
	want(1)
	mu.Lock()
	tokens = 42
	mu.Unlock()
	want(42)
}
