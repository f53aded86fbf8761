package sim

// Open-addressing tables keyed by block hashes for the reference caches.
// Sequence hashes are XXH3 outputs, already uniform, so the low bits index
// the table directly. Go maps slow down badly under the reference LRU's
// constant insert/delete churn (tombstones lengthen probes); linear probing
// with backward-shift deletion leaves no tombstones.

// blockMap maps hashes to node ids (> 0); 0 marks an empty slot.
type blockMap struct {
	keys []uint64
	vals []int32
	mask uint64
	n    int
}

func newBlockMap(capacity int) *blockMap {
	size := 16
	for size < 2*capacity {
		size <<= 1
	}
	return &blockMap{keys: make([]uint64, size), vals: make([]int32, size), mask: uint64(size - 1)}
}

func (m *blockMap) get(k uint64) (int32, bool) {
	for i := k & m.mask; ; i = (i + 1) & m.mask {
		if m.vals[i] == 0 {
			return 0, false
		}
		if m.keys[i] == k {
			return m.vals[i], true
		}
	}
}

// put inserts k → v (v > 0); k must be absent and the table not over half
// full (the caller bounds the number of keys).
func (m *blockMap) put(k uint64, v int32) {
	if 2*(m.n+1) > len(m.keys) {
		m.grow()
	}
	i := k & m.mask
	for m.vals[i] != 0 {
		i = (i + 1) & m.mask
	}
	m.keys[i], m.vals[i] = k, v
	m.n++
}

func (m *blockMap) grow() {
	old := *m
	*m = *newBlockMap(len(old.keys))
	for i, v := range old.vals {
		if v != 0 {
			m.put(old.keys[i], v)
		}
	}
}

// del removes k, shifting later entries of its probe run back.
func (m *blockMap) del(k uint64) {
	i := k & m.mask
	for {
		if m.vals[i] == 0 {
			return
		}
		if m.keys[i] == k {
			break
		}
		i = (i + 1) & m.mask
	}
	m.n--
	for j := (i + 1) & m.mask; m.vals[j] != 0; j = (j + 1) & m.mask {
		home := m.keys[j] & m.mask
		// Move j into the hole at i unless its home lies cyclically in (i, j].
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			m.keys[i], m.vals[i] = m.keys[j], m.vals[j]
			i = j
		}
	}
	m.vals[i] = 0
}

// hashSet is a grow-only set of hashes, kept at most 3/4 full: the ideal
// reference of a long trace holds millions of blocks.
type hashSet struct {
	keys    []uint64
	mask    uint64
	n       int
	hasZero bool
}

func newHashSet() *hashSet {
	return &hashSet{keys: make([]uint64, 1024), mask: 1023}
}

func (s *hashSet) has(k uint64) bool {
	if k == 0 {
		return s.hasZero
	}
	for i := k & s.mask; ; i = (i + 1) & s.mask {
		switch s.keys[i] {
		case k:
			return true
		case 0:
			return false
		}
	}
}

func (s *hashSet) add(k uint64) {
	if k == 0 {
		s.hasZero = true
		return
	}
	if 4*(s.n+1) > 3*len(s.keys) {
		old := s.keys
		s.keys, s.mask, s.n = make([]uint64, 2*len(old)), uint64(2*len(old)-1), 0
		for _, x := range old {
			if x != 0 {
				s.insert(x)
			}
		}
	}
	s.insert(k)
}

func (s *hashSet) insert(k uint64) {
	for i := k & s.mask; ; i = (i + 1) & s.mask {
		switch s.keys[i] {
		case k:
			return
		case 0:
			s.keys[i] = k
			s.n++
			return
		}
	}
}
