package main

import (
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/engine"
)

// TestMockSchedulingPolicy: as vLLM, an fcfs kvmock refuses a non-zero
// priority with 400 and takes priority 0; one started with a priority
// --scheduling-policy serves a request with a priority (what kvrouter
// serve --tenant-engine-priority sends, up to 2³²).
func TestMockSchedulingPolicy(t *testing.T) {
	fcfs := startMock(t, nil, true)
	b := chatBody("Say hello.", 3, false)
	b["priority"] = 4294967296
	if status, body := post(t, fcfs.url+"/v1/chat/completions", b); status != http.StatusBadRequest || !strings.Contains(string(body), "Priority scheduling is not enabled") {
		t.Errorf("fcfs, priority 2^32: %d %s, want 400", status, body)
	}
	b["priority"] = 0
	if status, body := post(t, fcfs.url+"/v1/chat/completions", b); status != http.StatusOK {
		t.Errorf("fcfs, priority 0: %d %s", status, body)
	}
	prio := startMock(t, func(c *config) { c.SchedulingPolicy = engine.SchedulingPriority }, true)
	b["priority"] = 4294967296
	if status, body := post(t, prio.url+"/v1/chat/completions", b); status != http.StatusOK {
		t.Errorf("priority policy, priority 2^32: %d %s", status, body)
	}
}
